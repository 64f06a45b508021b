"""Loading the models a run trains (policy, reference, tokenizer; `loading`) and speaking to them (`kv_cache`: the
KV cache's forward keyword, the causal LM inside DDP / PEFT wrappers)."""
