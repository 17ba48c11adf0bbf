"""Slice execution on llama.cpp's ggml kernels.

    SliceEngine  runs layers [start, stop) of a GGUF model for many requests (kernels.slice)
    ModelSpec    hyper-parameters from GGUF metadata; SliceSpec: what a node runs (kernels.spec)
    Tokenizer    llama.cpp's tokenizer and the model's chat template (kernels.tokenizer)
    Sampler      greedy / temperature / top-k / top-p (kernels.sampling)
"""
