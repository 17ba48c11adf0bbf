"""Slice execution on llama.cpp's ggml kernels.

    SliceEngine  runs layers [start, stop) of a GGUF model for many requests (kernels.slice)
    ModelSpec    hyper-parameters from GGUF metadata; SliceSpec: what a node runs (kernels.spec)
    Tokenizer    llama.cpp's tokenizer and the model's chat template (kernels.tokenizer)
    Sampler      greedy / temperature / top-k / top-p (kernels.sampling)

The modules, one job each:

    archs/        one record per architecture: its RoPE mode, its tensors (required and optional)
                  and its attention and FFN builders; read by spec, weights and graph alike
    spec.py       ModelSpec (GGUF metadata, resolved against the record) and SliceSpec
    weights.py    SliceWeights: exactly the record's tensors of a slice, zero-copy from the map
    graph.py      GraphBuilder's shared helpers and the layer loop around the record's builders
    graph_inputs.py  a graph's host-side inputs (positions, masks, KV cells) and its outputs
    graph_cache.py   placed graphs, each with its own allocator, kept by shape for reuse
    slice.py      SliceEngine: requests, their KV caches, batches, remote experts
    kv_cache.py   one request's F16 K/V tensors for a slice's layers
    experts.py    ExpertEngine: some experts of some MoE layers, for expert parallelism
    backend.py    the ggml CPU backend; ggml.py: the ctypes bindings; gguf_file.py: the GGUF map
    speed.py      how fast this machine runs one layer of the model (ms per layer per token)
    tokenizer.py, sampling.py, oracle_llama.py (llama-cpp-python as the tests' oracle)
    errors.py     the one-line errors for bad input
"""
