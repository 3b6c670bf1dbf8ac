"""The old pass: how the old log-probs are computed in each scoring mode (`OldLogprobScorer` in `scorer.py`), the
forwards it runs (`forward.py`), its copies (`copies.py`), the fused fp32 head (`fused_head.py`), the kept-set
log-probs of TRL's own forward through the LM head (`kept_head.py`), guided layers (`layer_spec.py`), PEFT
(`adapters.py`) and sharded policies (`sharding/`). Usable without a trainer."""
