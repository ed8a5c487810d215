"""Built-in plugin: generation backends and the stage that samples a model's outputs."""

from alpacafarm import hookimpl


@hookimpl
def register_generation_backends(register):
    runtime = ("spec", "model_path")  # the recipe's model block and the model to sample from
    register("transformers", "alpacafarm_generation.backends:transformers_backend", runtime=runtime,
             description="batched sampling with a transformers model (the default)")
    register("openai", "alpacafarm_generation.backends:OpenAIGenerator", runtime=runtime,
             description="an OpenAI-compatible completions server (vLLM, llama.cpp, TGI)")
    register("vllm", "alpacafarm_generation.backends:vllm_backend", runtime=runtime,
             description="vLLM in-process (extra 'vllm')")
    register("openvino", "alpacafarm_generation.openvino_backend:openvino_backend", runtime=runtime,
             description="OpenVINO GenAI continuous batching on CPU (extra 'fast-cpu')")


@hookimpl
def register_methods(register):
    register("generate_outputs", "alpacafarm_generation.stage:GenerateOutputs",
             description="sample the model's outputs for an instruction split (JSONL)")
