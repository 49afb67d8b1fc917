"""The fence around transformers, TRL, accelerate and vLLM: every private name odc_hf uses, with the versions it was
tested on. No other module of odc_hf touches one."""
