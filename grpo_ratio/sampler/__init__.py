"""The sampler: what the rollouts were drawn from. `generate.py` records log-probs and kept sets inside transformers
`generate`; `vllm.py` reads them from vLLM; `settings.py` holds the sampling settings generation really uses."""
