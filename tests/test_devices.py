"""Devices: the registry, `--device` choices, and the device path of the slice engine (weights
copied into the device's buffer, KV cache and graphs allocated there).

Everywhere: the CPU sent down the copying path (``upload=True``) must give logits bit-identical to
the zero-copy CPU path, since the same kernels run on the same bytes. Where a GPU backend is in
the build (tests/gpu/, the environment scripts/gpu-env.sh makes), tests/test_gpu_devices.py
checks a real device against llama-cpp-python on that device.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels import ggml
from kernels.devices import Device, DeviceError, available_devices, choose_device
from kernels.gguf_file import GGUFFile
from kernels.slice import Placement, SliceEngine
from kernels.spec import ModelSpec, SliceSpec
from tests.conftest import decode_logits, run_split

PROMPT = [1, 504, 3458, 282, 4649, 314, 3217, 30, 378, 1326, 282, 2463, 314]


def fake_devices() -> list[Device]:
    return [Device("CPU", "cpu", 0, "cpu", "Test CPU", 8 << 30, 16 << 30),
            Device("CUDA0", "cuda", 0, "gpu", "RTX A", 20 << 30, 24 << 30),
            Device("CUDA1", "cuda", 1, "gpu", "RTX B", 10 << 30, 12 << 30),
            Device("Vulkan0", "vulkan", 0, "gpu", "llvmpipe", 1 << 30, 2 << 30)]


def test_this_build_offers_exactly_one_cpu():
    devices = available_devices()
    assert [d.label for d in devices if d.is_cpu] == ["cpu"]
    cpu = choose_device("cpu")
    assert cpu.memory_total > 0 and cpu.handle


@pytest.mark.parametrize("wanted, name", [("auto", "CUDA0"), ("cpu", "CPU"), ("cuda", "CUDA0"), ("cuda:1", "CUDA1"),
                                          ("CUDA:1", "CUDA1"), ("vulkan:0", "Vulkan0"), ("hip", None)])
def test_choose_device_by_what_users_type(wanted, name):
    if name is None:
        with pytest.raises(DeviceError, match=r"no rocm device: this build offers cpu \(Test CPU\), cuda:0 \(RTX A\)"):
            choose_device(wanted, fake_devices())
        return
    assert choose_device(wanted, fake_devices()).name == name


def test_auto_without_a_gpu_is_the_cpu_and_bad_names_are_one_line():
    cpu_only = fake_devices()[:1]
    assert choose_device("auto", cpu_only).is_cpu
    for bad in ("cuda:x", "cu da", "cuda:-1", ":1"):
        with pytest.raises(DeviceError) as e:
            choose_device(bad, cpu_only)
        assert "\n" not in str(e.value)
    with pytest.raises(DeviceError, match="no cuda:2 device"):
        choose_device("cuda:2", fake_devices())


@pytest.fixture(scope="module")
def gguf(bundled_model):
    with GGUFFile(bundled_model) as f:
        yield f


def _engines(gguf, cuts: list[int], **kwargs) -> list[SliceEngine]:
    n = ModelSpec.from_gguf(gguf).n_layer
    bounds = [0, *cuts, n]
    return [SliceEngine(gguf, SliceSpec(a, b, has_embedding=a == 0, has_lm_head=b == n), n_threads=2, **kwargs)
            for a, b in zip(bounds, bounds[1:])]


@pytest.mark.slow  # ~15 s: 262 decode steps through two engine sets
def test_the_upload_path_is_bit_identical_to_the_zero_copy_path(gguf):
    """The CPU forced down the device path: every weight copied into a buffer of its own (not the
    map), the KV cache and graphs allocated by the backend. Same kernels, same bytes: same bits,
    whole model and as three slices, prefill and decode across the KV cache's growth."""
    mapped = _engines(gguf, [])
    uploaded = _engines(gguf, [], placement=Placement(upload=True))
    sliced = _engines(gguf, [10, 20], placement=Placement(upload=True))
    try:
        lo, hi = gguf.part_address(0), gguf.part_address(0) + gguf.size  # (one part: the bundled model)
        for engine in uploaded + sliced:
            weights = engine.weights
            assert set(weights.uploaded) == set(weights.tensor_names) and not weights.repacked
            assert weights.copied_bytes >= weights.n_bytes
            some = weights.layers[engine.slice.start].wq if engine.slice.stop > engine.slice.start \
                else weights.output
            assert not lo <= ggml.tensor_view(some).data < hi, "a weight still points into the map"
        want = run_split(mapped, PROMPT)
        assert np.array_equal(run_split(uploaded, PROMPT), want)
        assert np.array_equal(run_split(sliced, PROMPT), want)

        # Decode one token at a time past the KV cache's first 256 cells (it grows by copying).
        tokens = (PROMPT * 21)[:262]
        assert np.array_equal(decode_logits(sliced, tokens, 250), decode_logits(mapped, tokens, 250))
    finally:
        for engine in mapped + uploaded + sliced:
            engine.close()


def test_a_weight_the_device_cannot_hold_stays_in_host_memory(gguf, monkeypatch):
    """A device that refuses a tensor (ggml-vulkan refuses one larger than its largest storage
    buffer: a Kimi-width dense FFN matrix on lavapipe, where uploading it aborted ggml's scheduler)
    gets the others; that one stays in the map and the scheduler runs its matmul on the CPU. Here
    the CPU on the device path stands in for such a device (the refusal is faked: no device here
    has the limit); the logits must be the all-uploaded path's bits."""
    refused = {"blk.3.ffn_down.weight", "blk.3.attn_q.weight"}
    supports = ggml.backend_supports_op

    def refusing(backend: int, tensor: int) -> bool:
        name = ggml.get_name(tensor).decode() if ggml.get_name(tensor) else ""
        return name not in refused and supports(backend, tensor)

    uploaded = _engines(gguf, [], placement=Placement(upload=True))
    monkeypatch.setattr(ggml, "backend_supports_op", refusing)
    try:
        (kept,) = _engines(gguf, [], placement=Placement(upload=True))
    finally:
        monkeypatch.setattr(ggml, "backend_supports_op", supports)
    try:
        assert set(kept.weights.kept_in_host) == refused and not refused & set(kept.weights.uploaded)
        assert kept.backend.partial and "2 tensors too large for it in host memory" in kept.placement()
        assert np.array_equal(run_split([kept], PROMPT), run_split(uploaded, PROMPT))
    finally:
        for engine in [kept, *uploaded]:
            engine.close()


def test_the_cpu_device_keeps_weights_in_the_map(gguf):
    (engine,) = _engines(gguf, [], placement=Placement(device=choose_device("cpu")))
    try:
        assert engine.weights.uploaded == () and engine.weights.copied_bytes == 0
        assert engine.backend.name == "cpu"
        # compute buffers: a kept decode graph's allocator holds one; releasing the request drops
        # its graphs (on the CPU their allocators are freed, not kept)
        assert engine.compute_buffer_bytes() == 0
        engine.forward(b"r", start_pos=0, tokens=[1, 504, 3458])
        engine.forward(b"r", start_pos=3, tokens=[282])
        held = engine.compute_buffer_bytes()
        assert held > engine.spec.n_vocab * 4  # at least the logits row
        engine.release(b"r")
        assert engine.compute_buffer_bytes() == 0
    finally:
        engine.close()


def test_layers_that_fit_takes_the_first_layers_within_the_budget(gguf):
    """Partial offload's split (the device part is tested where a GPU build exists): weights plus
    one request's KV cache per layer, first layers first; the whole slice fits only with its
    embedding and LM head counted."""
    from kernels.slice import layers_that_fit

    spec = ModelSpec.from_gguf(gguf)
    kv = 2 * 2 * spec.n_embd_kv * 512
    trunk = SliceSpec(4, 15)
    assert layers_that_fit(spec, trunk, 10**12, 512) is None
    assert layers_that_fit(spec, trunk, sum(spec.layer_bytes[4:7]) + 3 * kv, 512) == range(4, 7)
    assert layers_that_fit(spec, trunk, sum(spec.layer_bytes[4:7]) + 3 * kv - 1, 512) == range(4, 6)
    assert layers_that_fit(spec, trunk, 0, 512) == range(4, 4)
    whole = SliceSpec(0, spec.n_layer, has_embedding=True, has_lm_head=True)
    layers_only = sum(spec.layer_bytes) + spec.n_layer * kv
    assert layers_that_fit(spec, whole, layers_only, 512) == range(0, spec.n_layer)  # no room for the ends
    assert layers_that_fit(spec, whole, layers_only + spec.embedding_bytes + spec.lm_head_bytes, 512) is None


def test_a_mixture_of_experts_slice_keeps_its_dense_part_on_the_device_and_routed_experts_in_ram(tiny_model):
    """Placement by tensor kind (issue 33 item 1), on the CPU sent down the device path: a budget
    that holds every layer's dense part and KV cache and the routed experts of the first two MoE
    layers copies exactly those, leaves the other layers' routed experts in the map (host RAM),
    says so in one line, and computes the same bits as the zero-copy path (the oracle rule holds
    on the upload path). A budget too small for even one layer's dense part: everything on the
    CPU, said so, still the same bits."""
    from kernels.device_split import DeviceSplit, split_for_device

    path = tiny_model("deepseek2-q8_0")
    with GGUFFile(path) as gguf:
        spec = ModelSpec.from_gguf(gguf)
        trunk = SliceSpec(0, spec.n_layer)
        kv = spec.kv_bytes_per_token_per_layer * 64
        moe = [il for il in trunk.layers if spec.is_moe_layer(il)]
        assert len(moe) >= 3 and spec.layer_expert_bytes[0] == 0 and all(spec.layer_expert_bytes[il] for il in moe)
        dense = sum(spec.layer_bytes) - sum(spec.layer_expert_bytes) + spec.n_layer * kv
        budget = dense + spec.layer_expert_bytes[moe[0]] + spec.layer_expert_bytes[moe[1]]
        split = split_for_device(spec, trunk, budget, 64)
        assert split == DeviceSplit(range(0, spec.n_layer), frozenset({0, moe[0], moe[1]}))
        assert split_for_device(spec, trunk, budget - 1, 64).experts == frozenset({0, moe[0]})
        assert split_for_device(spec, trunk, 10**12, 64) is None

        mapped = SliceEngine(gguf, trunk, n_threads=2, max_context=64)
        engines = {b: SliceEngine(gguf, trunk, n_threads=2, max_context=64,
                                  placement=Placement(upload=True, gpu_memory=b)) for b in (budget, 1)}
        try:
            routed = {name for name in engines[budget].weights.tensor_names if "_exps." in name}
            on_device = set(engines[budget].weights.uploaded)
            assert {n for n in routed if n in on_device} == {n for n in routed
                                                             if n.startswith((f"blk.{moe[0]}.", f"blk.{moe[1]}."))}
            assert set(engines[budget].weights.tensor_names) - routed <= on_device  # every dense tensor
            assert engines[budget].placement() == (f"cpu for layers [0, {spec.n_layer}) and the experts of "
                                                   f"[{moe[0]}, {moe[2]}); experts of [{moe[2]}, {spec.n_layer}) in RAM (cpu)")
            assert engines[1].weights.uploaded == () and engines[1].placement() == "cpu (nothing fits on cpu)"
            x = np.random.default_rng(0).standard_normal((6, spec.n_embd)).astype(np.float32)
            want = [mapped.forward("r", start_pos=0, hidden=x[:5]), mapped.forward("r", start_pos=5, hidden=x[5:])]
            for engine in engines.values():  # a prompt, then a decode step
                assert np.array_equal(engine.forward("r", start_pos=0, hidden=x[:5]), want[0])
                assert np.array_equal(engine.forward("r", start_pos=5, hidden=x[5:]), want[1])
        finally:
            mapped.close()
            for engine in engines.values():
                engine.close()
