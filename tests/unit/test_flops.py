"""FLOPs and MFU: count_flops against torch's own FlopCounterMode, the steps' flops attributes
with an injected clock, the peak table by fake device names, the PERFSDK_PEAK_FLOPS override,
the measured CPU peak (cached), and where MFU shows up (summary, advisor)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import perfsdk
from perfsdk import advise, auto
from perfsdk.errors import PerfSDKWarning
from perfsdk.flops import GPUS, ModelFlops, count_flops, find_peak, peak_flops, peaks
from perfsdk.testing import FakeCuda, FakeDeviceProperties, capture, use_fake_clock, use_fake_cuda


def torch_count(fn, *args, backward: bool = False) -> int:
    """FlopCounterMode's own count of the same call (backward: out.sum().backward())."""
    with FlopCounterMode(display=False) as counter:
        out = fn(*args)
        if backward:
            out.sum().backward()
    return int(counter.get_total_flops())


@pytest.fixture(autouse=True)
def no_peak_env(monkeypatch) -> Iterator[None]:
    monkeypatch.delenv("PERFSDK_PEAK_FLOPS", raising=False)
    peaks.clear_peak_cache()
    yield
    peaks.clear_peak_cache()


@pytest.fixture
def measured(monkeypatch) -> list[str]:
    """The CPU measurement, counted and made instant (its value: 1e11 FLOP/s)."""
    calls: list[str] = []

    def fake(dtype: object = "fp32", *, budget_s: float = 0.3) -> float:
        calls.append(str(dtype))
        return 1e11

    monkeypatch.setattr(peaks, "measure_cpu_peak", fake)
    return calls


def gpu(name: str) -> FakeCuda:
    fake = FakeCuda()
    fake.devices = [FakeDeviceProperties(name=name)]
    return fake


# -- count_flops ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("batch", "d_in", "d_out"), [(8, 64, 32), (3, 5, 7)])
def test_linear_forward_is_2_b_in_out_and_backward_triples_it(batch, d_in, d_out) -> None:
    layer = nn.Linear(d_in, d_out)
    x = torch.randn(batch, d_in, requires_grad=True)
    forward = count_flops(layer, x)
    both = count_flops(layer, x, backward=True)
    assert forward == 2 * batch * d_in * d_out
    assert both == 3 * forward  # grad input + grad weight
    assert forward == torch_count(layer, x)
    layer.zero_grad(set_to_none=True)
    assert both == torch_count(layer, x, backward=True)


def test_an_input_without_grad_gets_no_input_gradient() -> None:
    layer = nn.Linear(16, 4)
    x = torch.randn(2, 16)  # autograd computes no grad for x: the backward is grad weight only
    assert count_flops(layer, x, backward=True) == 2 * count_flops(layer, x)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2)
        self.fc = nn.Linear(16 * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def test_a_conv_net_counts_what_flop_counter_mode_counts() -> None:
    torch.manual_seed(0)
    net = ConvNet()
    x = torch.randn(4, 3, 16, 16)
    ours = count_flops(net, x), count_flops(net, x, backward=True)
    theirs = torch_count(net, x), torch_count(net, x, backward=True)
    assert ours == theirs
    assert ours[0] > 0
    assert ours[1] > ours[0]


def test_no_grad_is_left_behind_and_existing_grads_are_kept() -> None:
    net = ConvNet()
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    count_flops(net, x, backward=True)
    assert all(p.grad is None for p in net.parameters())
    assert x.grad is None
    net(x).sum().backward()  # the user's own gradients, accumulated before the count
    grads = {n: p.grad for n, p in net.named_parameters()}
    values = {n: g.clone() for n, g in grads.items()}
    count_flops(net, x, backward=True)
    for name, p in net.named_parameters():
        assert p.grad is grads[name]  # the same tensor, with the same values
        torch.testing.assert_close(p.grad, values[name], rtol=0, atol=0)


@pytest.mark.parametrize("call", ["module", "bound method"])
def test_module_state_is_put_back(call) -> None:
    net = ConvNet().train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    fn = net if call == "module" else net.forward
    count_flops(fn, torch.randn(4, 3, 16, 16), backward=True)
    after = net.state_dict()
    assert after["bn.num_batches_tracked"].item() == 0
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)
    assert net.training


class Block(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)
        self.reentrant = reentrant

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return self.inner(x)
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recomputation_is_not_credited(reentrant) -> None:
    x = torch.randn(4, 32, requires_grad=True)
    plain = count_flops(Block(None), x, backward=True)
    assert count_flops(Block(reentrant), x, backward=True) == plain
    assert torch_count(Block(reentrant), x, backward=True) > plain  # torch's count recomputes


def test_outputs_in_a_tuple_or_dict_add_up() -> None:
    a, b = nn.Linear(8, 4), nn.Linear(8, 2)
    x = torch.randn(3, 8, requires_grad=True)
    single = count_flops(a, x, backward=True) + count_flops(b, x, backward=True)
    assert count_flops(lambda t: (a(t), b(t)), x, backward=True) == single
    assert count_flops(lambda t: {"a": a(t), "b": [b(t)], "n": 3}, x, backward=True) == single
    assert a.weight.grad is None
    assert b.weight.grad is None


def test_kwargs_reach_the_call() -> None:
    layer = nn.Linear(8, 4)
    assert count_flops(lambda *, t: layer(t), t=torch.ones(2, 8)) == 2 * 2 * 8 * 4


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="fn_or_module"):
        count_flops(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backward"):
        count_flops(nn.Linear(2, 2), torch.ones(1, 2), backward=1)  # type: ignore[arg-type]
    with torch.no_grad(), pytest.raises(ValueError, match="requires grad"):
        count_flops(nn.Linear(2, 2), torch.ones(1, 2), backward=True)


def test_model_flops_adds_up_its_blocks() -> None:
    layer = nn.Linear(8, 4)
    counted = ModelFlops()
    for _ in range(2):
        with counted:
            layer(torch.ones(1, 8))
    assert counted.total == 2 * (2 * 8 * 4)


# -- peak_flops ----------------------------------------------------------------------------------
TABLE = [  # (reported name, dtype, expected peak): what the datasheets say (dense)
    ("NVIDIA H100 80GB HBM3", None, 989.5e12),
    ("NVIDIA H100 80GB HBM3", "tf32", 494.5e12),
    ("NVIDIA H100 80GB HBM3", torch.float32, 67e12),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756.5e12),
    ("NVIDIA H100 NVL", "fp16", 835.5e12),
    ("NVIDIA H200", None, 989.5e12),
    ("NVIDIA GH200 480GB", None, 989.5e12),
    ("NVIDIA B200", None, 2250e12),
    ("NVIDIA A100-SXM4-80GB", None, 312e12),
    ("NVIDIA A100-PCIE-40GB", "tf32", 156e12),
    ("NVIDIA A100 80GB PCIe", "fp32", 19.5e12),
    ("NVIDIA L40S", None, 362.05e12),
    ("NVIDIA L40", None, 181.05e12),
    ("NVIDIA L4", None, 121e12),
    ("NVIDIA A10", None, 125e12),
    ("NVIDIA A40", None, 149.7e12),
    ("Tesla V100-SXM2-16GB", None, 125e12),  # no bf16: the fp16 tensor peak
    ("Tesla V100-PCIE-32GB", "fp16", 112e12),
    ("Tesla V100-SXM2-16GB", "tf32", 15.7e12),  # no TF32: FP32 matmuls at the FP32 peak
    ("Tesla T4", None, 65e12),
    ("NVIDIA GeForce RTX 4090", None, 165.2e12),
    ("AMD Instinct MI300X", None, 1307.4e12),
]


@pytest.mark.parametrize(("name", "dtype", "expected"), TABLE)
def test_gpu_peaks_come_from_the_table_by_device_name(name, dtype, expected) -> None:
    with use_fake_cuda(gpu(name)):
        assert peak_flops(dtype) == expected
        peak = find_peak(dtype)
        assert peak is not None
        assert peak.device == name
        assert peak.source.strip()


def test_every_table_row_cites_a_source_and_matches_its_own_name() -> None:
    for spec in GPUS:
        assert spec.source.startswith(("https://", "NVIDIA")), spec.name
        assert peaks.spec_for(spec.name) is spec, spec.name  # no row hides another


def test_an_unknown_gpu_has_no_peak_and_warns_once_naming_the_variable() -> None:
    with use_fake_cuda(gpu("NVIDIA A10G")):
        with pytest.warns(PerfSDKWarning, match="PERFSDK_PEAK_FLOPS") as caught:
            assert peak_flops() is None
        assert "NVIDIA A10G" in str(caught[0].message)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert peak_flops() is None  # once


def test_a_dtype_the_gpu_lacks_has_no_peak() -> None:
    with use_fake_cuda(gpu("Tesla T4")), pytest.warns(PerfSDKWarning, match="bf16"):
        assert peak_flops(torch.bfloat16) is None


def test_the_variable_overrides_the_table(monkeypatch) -> None:
    monkeypatch.setenv("PERFSDK_PEAK_FLOPS", "100T")
    with use_fake_cuda(gpu("NVIDIA H100 80GB HBM3")):
        assert peak_flops() == 100e12
        assert find_peak().source == "PERFSDK_PEAK_FLOPS"  # type: ignore[union-attr]
    monkeypatch.setenv("PERFSDK_PEAK_FLOPS", "2.5e14")
    with use_fake_cuda(gpu("Unknown GPU")):
        assert peak_flops() == 2.5e14  # no warning: the variable answers


@pytest.mark.parametrize("raw", ["fast", "-1", "0", "inf", "12X", "nan"])
def test_a_bad_variable_warns_naming_it_and_falls_back(monkeypatch, raw) -> None:
    monkeypatch.setenv("PERFSDK_PEAK_FLOPS", raw)
    with use_fake_cuda(gpu("NVIDIA A100-SXM4-40GB")), pytest.warns(
            PerfSDKWarning, match=r"PERFSDK_PEAK_FLOPS=.*accepted values"):
        assert peak_flops() == 312e12


@pytest.mark.parametrize(("raw", "value"), [("989e12", 989e12), ("989T", 989e12),
                                            ("1.5P", 1.5e15), ("500 GFLOPS", 500e9),
                                            ("  2e9 ", 2e9)])
def test_the_variable_accepts_plain_and_prefixed_numbers(raw, value) -> None:
    assert peaks.parse_peak(raw) == value


def test_a_cpu_peak_is_measured_once_per_dtype(measured) -> None:
    assert peak_flops(device="cpu") == 1e11
    assert peak_flops(device="cpu") == 1e11
    assert peak_flops("tf32", device="cpu") == 1e11  # a CPU has no TF32: the fp32 measurement
    assert measured == ["fp32"]
    assert find_peak(device="cpu") == peaks.Peak(1e11, "fp32", "cpu", "measured")
    peak_flops(torch.bfloat16, device="cpu")
    assert measured == ["fp32", "bf16"]


def test_without_cuda_in_use_the_peak_is_the_cpus(measured) -> None:
    fake = gpu("NVIDIA H100 80GB HBM3")
    fake.initialized = False  # the application has not initialized CUDA: perfsdk never does
    with use_fake_cuda(fake):
        assert peak_flops() == 1e11
    assert measured == ["fp32"]


def test_the_real_cpu_measurement_is_positive() -> None:
    assert peaks.measure_cpu_peak("fp32", budget_s=0.05) > 0


def test_bad_peak_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="dtype"):
        peak_flops("int8")
    with pytest.raises(ValueError, match="device"):
        peak_flops(device="tpu:0")
    with pytest.raises(ValueError, match="device"):
        peak_flops(device=True)


# -- steps, summary, advisor ---------------------------------------------------------------------
def test_a_step_given_flops_gets_its_rate_and_mfu(monkeypatch) -> None:
    monkeypatch.setenv("PERFSDK_PEAK_FLOPS", "1e12")
    with use_fake_clock() as clock, capture() as cap:
        with perfsdk.step(samples=8, flops=4e9):
            clock.advance(20)
        with auto.step(flops=3_000_000):
            clock.advance(10)
        with auto.step(samples=8):  # no flops: no flops attributes
            clock.advance(10)
    first, second, third = cap.named("step")
    assert first.attributes["perfsdk.flops"] == 4e9
    assert first.attributes["perfsdk.flops_per_s"] == 4e9 / 0.020
    assert first.attributes["perfsdk.mfu"] == 4e9 / 0.020 / 1e12
    assert first.attributes["perfsdk.samples_per_s"] == 8 / 0.020
    assert second.attributes["perfsdk.flops_per_s"] == 3e6 / 0.010
    assert second.attributes["perfsdk.mfu"] == 3e6 / 0.010 / 1e12
    assert "perfsdk.samples_per_s" not in second.attributes
    assert not any(k.startswith("perfsdk.flops") or k == "perfsdk.mfu"
                   for k in third.attributes)


def test_a_step_on_an_unknown_gpu_has_a_rate_but_no_mfu() -> None:
    with use_fake_cuda(gpu("Mystery GPU")), use_fake_clock() as clock, capture() as cap, \
            pytest.warns(PerfSDKWarning, match="PERFSDK_PEAK_FLOPS"), auto.step(flops=1e9):
        clock.advance(5)
    (step,) = cap.named("step")
    assert step.attributes["perfsdk.flops_per_s"] == 1e9 / 0.005
    assert "perfsdk.mfu" not in step.attributes


def test_a_step_on_a_known_gpu_uses_its_table_peak() -> None:
    with use_fake_cuda(gpu("NVIDIA A100-SXM4-80GB")), use_fake_clock() as clock, \
            capture() as cap, auto.step(flops=312e9):
        clock.advance(1000)
    (step,) = cap.named("step")
    assert step.attributes["perfsdk.mfu"] == pytest.approx(1e-3, rel=1e-12)


@pytest.mark.parametrize("bad", [0, -5, float("nan"), float("inf"), True, "1e9"])
def test_bad_flops_are_refused_naming_the_argument(bad) -> None:
    with pytest.raises(ValueError, match="flops="):
        auto.step(flops=bad)


def test_the_summary_gets_flop_rate_and_mfu_columns(monkeypatch) -> None:
    monkeypatch.setenv("PERFSDK_PEAK_FLOPS", "1e11")
    with use_fake_clock() as clock:
        with perfsdk.timed_region("setup"):
            clock.advance(1)
        assert "MFU" not in str(perfsdk.summary(show=False))
        for ms in (10, 30):
            with auto.step(flops=1e9):
                clock.advance(ms)
        auto.end_step()
    summary = perfsdk.summary(show=False)
    row = summary["step"]
    assert row.flops_per_s == pytest.approx(2e9 / 0.040)  # all FLOPs over all the time
    assert row.mfu == pytest.approx(2e9 / 0.040 / 1e11)
    assert summary["setup"].flops_per_s is None
    assert summary["setup"].mfu is None
    text = str(summary)
    header = text.splitlines()[0]
    assert "FLOP/s" in header
    assert "MFU" in header
    step_line = next(line for line in text.splitlines() if line.startswith("step"))
    assert "50.0 G" in step_line
    assert "50.0%" in step_line


def test_the_compute_finding_states_the_mfu(monkeypatch) -> None:
    monkeypatch.setenv("PERFSDK_PEAK_FLOPS", "1e10")
    with use_fake_clock() as clock, capture() as cap:
        for _ in range(5):
            with auto.step(flops=1e8):
                with perfsdk.timed_region("forward", category="compute"):
                    clock.advance(40)
                clock.advance(1)
        auto.end_step()
    (compute,) = [f for f in advise(cap.regions).findings if f.kind == "compute"]
    assert compute.data["mfu"] == pytest.approx(1e8 / 0.041 / 1e10)
    assert compute.data["flops_per_s"] == pytest.approx(1e8 / 0.041)
    assert "MFU 24.4%" in compute.evidence
    assert "2.4 GFLOP/s achieved" in compute.evidence


def test_a_failing_formula_counts_zero_and_warns_instead_of_failing_the_op(monkeypatch) -> None:
    from perfsdk.flops import count as count_module

    def broken(*args: object, **kwargs: object) -> int:
        raise RuntimeError("no formula")

    mm = torch.ops.aten.mm
    monkeypatch.setitem(count_module._mapping(), mm, count_module._model_only(mm, broken))
    a, b = torch.ones(2, 3), torch.ones(3, 4)
    with pytest.warns(PerfSDKWarning, match="FLOP formula"):
        assert count_flops(torch.mm, a, b) == 0
    torch.testing.assert_close(torch.mm(a, b), torch.full((2, 4), 3.0))
