"""FSDP2 and DeepSpeed ZeRO-3 as the scorer sees them: `engines.py` (which engine, its refusals, `sharded_policy`),
`base.py` (`ShardedPolicy`, what the back-ends share), `fsdp2.py` and `zero3.py` (each engine's shadows and runners)."""
