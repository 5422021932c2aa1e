"""Engine integrations. Nothing here is imported by ``import kvshm``; import a submodule
explicitly (for vLLM, ``kvshm.integrations.vllm`` — vLLM loads it by ``spec_module_path``)."""
