"""Config: explicit argument > PERFSDK_* variable > default; bad values are named."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import perfsdk
from perfsdk import config
from perfsdk.config import Config, configure, get_config
from perfsdk.errors import PerfSDKWarning

DEFAULT = Config()


# -- defaults and environment -------------------------------------------------------------------
def test_defaults_with_empty_environment():
    cfg = Config.from_env({})
    assert cfg == Config(
        enabled=True, exporters=(), output_dir=Path("perfsdk-output"), sample_every=1,
        nvtx=True, service_name="perfsdk", export_timeout_s=5.0,
    )


@pytest.mark.parametrize(
    ("variable", "raw", "field", "expected"),
    [
        ("PERFSDK_ENABLED", "0", "enabled", False),
        ("PERFSDK_ENABLED", "off", "enabled", False),
        ("PERFSDK_ENABLED", " FALSE ", "enabled", False),
        ("PERFSDK_ENABLED", "yes", "enabled", True),
        ("PERFSDK_SYNC_GUARD", " Error ", "sync_guard", "error"),
        ("PERFSDK_SYNC_GUARD", "off", "sync_guard", "off"),
        ("PERFSDK_EXPORTER", "otlp", "exporters", ("otlp",)),
        ("PERFSDK_EXPORTER", "console, FILE", "exporters", ("console", "file")),
        ("PERFSDK_EXPORTER", "file,otlp,file", "exporters", ("file", "otlp")),
        ("PERFSDK_EXPORTER", "none", "exporters", ()),
        ("PERFSDK_OUTPUT_DIR", "/tmp/perf-out", "output_dir", Path("/tmp/perf-out")),
        ("PERFSDK_OUTPUT_DIR", "~/perf", "output_dir", Path("~/perf").expanduser()),
        ("PERFSDK_SAMPLE_EVERY", "7", "sample_every", 7),
        ("PERFSDK_NVTX", "0", "nvtx", False),
        ("PERFSDK_NVTX", "on", "nvtx", True),
        ("PERFSDK_SERVICE_NAME", "trainer", "service_name", "trainer"),
        ("PERFSDK_EXPORT_TIMEOUT", "0.25", "export_timeout_s", 0.25),
        ("PERFSDK_EXPORT_TIMEOUT", "30", "export_timeout_s", 30.0),
    ],
)
def test_environment_beats_default(variable, raw, field, expected):
    cfg = Config.from_env({variable: raw})
    assert getattr(cfg, field) == expected
    # every other field keeps its default
    others = {f: getattr(cfg, f) for f in Config.__dataclass_fields__ if f != field}
    assert others == {f: getattr(DEFAULT, f) for f in others}


def test_empty_variable_means_default():
    assert Config.from_env({"PERFSDK_ENABLED": "", "PERFSDK_SAMPLE_EVERY": "  "}) == DEFAULT


def test_otel_service_name_is_the_service_name_fallback():
    assert Config.from_env({"OTEL_SERVICE_NAME": "svc"}).service_name == "svc"
    env = {"OTEL_SERVICE_NAME": "svc", "PERFSDK_SERVICE_NAME": "mine"}
    assert Config.from_env(env).service_name == "mine"


@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
)
def test_otlp_endpoint_makes_otlp_the_default_exporter(variable):
    assert Config.from_env({variable: "http://127.0.0.1:4318"}).exporters == ("otlp",)
    # ... but an explicit PERFSDK_EXPORTER still wins
    env = {variable: "http://127.0.0.1:4318", "PERFSDK_EXPORTER": "none"}
    assert Config.from_env(env).exporters == ()
    env = {variable: "http://127.0.0.1:4318", "PERFSDK_EXPORTER": "console"}
    assert Config.from_env(env).exporters == ("console",)


def test_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("PERFSDK_SAMPLE_EVERY", "4")
    monkeypatch.setenv("PERFSDK_SERVICE_NAME", "from-os")
    cfg = Config.from_env()
    assert (cfg.sample_every, cfg.service_name) == (4, "from-os")


# -- bad environment values: warn once, name the variable and the accepted values, fall back ----
@pytest.mark.parametrize(
    ("variable", "raw", "field", "accepted"),
    [
        ("PERFSDK_ENABLED", "maybe", "enabled", "1/0, true/false"),
        ("PERFSDK_EXPORTER", "jaeger", "exporters", "otlp, console, file, none"),
        ("PERFSDK_EXPORTER", ",", "exporters", "otlp, console, file, none"),
        ("PERFSDK_EXPORTER", "none,otlp", "exporters", "'none' cannot be combined"),
        ("PERFSDK_SAMPLE_EVERY", "0", "sample_every", "integers from 1 to"),
        ("PERFSDK_SAMPLE_EVERY", "2.5", "sample_every", "integers from 1 to"),
        ("PERFSDK_NVTX", "2", "nvtx", "1/0, true/false"),
        ("PERFSDK_SYNC_GUARD", "strict", "sync_guard", "'off', 'count', 'warn', 'error'"),
        ("PERFSDK_EXPORT_TIMEOUT", "-1", "export_timeout_s", "seconds > 0"),
        ("PERFSDK_EXPORT_TIMEOUT", "soon", "export_timeout_s", "seconds > 0"),
        # Outside a sane range: inf, nan, more than a day, negative (issue 13).
        ("PERFSDK_EXPORT_TIMEOUT", "inf", "export_timeout_s", "<= 86400 (a day)"),
        ("PERFSDK_EXPORT_TIMEOUT", "nan", "export_timeout_s", "<= 86400 (a day)"),
        ("PERFSDK_EXPORT_TIMEOUT", "1e12", "export_timeout_s", "<= 86400 (a day)"),
        ("PERFSDK_GPU_SAMPLE_INTERVAL", "inf", "gpu_sample_interval_s", "to 86400 (a day)"),
        ("PERFSDK_GPU_SAMPLE_INTERVAL", "-0.1", "gpu_sample_interval_s", "from 0 (off)"),
        ("PERFSDK_SAMPLE_EVERY", "1e12", "sample_every", "integers from 1 to"),
        ("PERFSDK_EXPORT_BACKOFF_MIN", "inf", "export_backoff_min_s", "<= 86400 (a day)"),
        ("PERFSDK_EXPORT_BACKOFF_MAX", "0", "export_backoff_max_s", "seconds > 0"),
        ("PERFSDK_TRACE_MAX_REGIONS", "-5", "trace_max_regions", "integers from 1 to"),
        ("OTEL_BSP_MAX_QUEUE_SIZE", "0", "export_queue_size", "integers from 1 to 1,000,000"),
        ("OTEL_BSP_MAX_QUEUE_SIZE", "nan", "export_queue_size", "integers from 1 to 1,000,000"),
        ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "-1", "export_batch_size", "integers from 1 to"),
        ("OTEL_BSP_SCHEDULE_DELAY", "inf", "export_delay_s", "milliseconds from 0 to 86400000"),
        ("OTEL_BSP_SCHEDULE_DELAY", "-5", "export_delay_s", "milliseconds from 0 to 86400000"),
        ("OTEL_BSP_EXPORT_TIMEOUT", "0", "export_batch_timeout_s", "milliseconds > 0"),
        ("OTEL_BSP_EXPORT_TIMEOUT", "1e99", "export_batch_timeout_s", "milliseconds > 0"),
    ],
)
def test_bad_environment_value_warns_once_and_falls_back(variable, raw, field, accepted):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = Config.from_env({variable: raw})
        second = Config.from_env({variable: raw})
    assert getattr(first, field) == getattr(DEFAULT, field)
    assert getattr(second, field) == getattr(DEFAULT, field)
    ours = [w for w in seen if issubclass(w.category, PerfSDKWarning)]
    assert len(ours) == 1, [str(w.message) for w in seen]
    message = str(ours[0].message)
    assert variable in message
    assert repr(raw) in message
    assert accepted in message
    assert perfsdk.diagnostics()["warnings"][f"env:{variable}"] == 2


def test_bad_environment_value_never_raises_even_with_warnings_as_errors(monkeypatch):
    # pytest runs with filterwarnings=error: a typo in a launcher's variable must still not
    # kill the run.
    monkeypatch.setenv("PERFSDK_SAMPLE_EVERY", "zero")
    cfg = config.reset_from_env()
    assert cfg.sample_every == 1
    assert get_config() is cfg


def test_bad_variable_does_not_spoil_good_ones():
    with pytest.warns(PerfSDKWarning, match="PERFSDK_NVTX"):
        cfg = Config.from_env({"PERFSDK_NVTX": "perhaps", "PERFSDK_SAMPLE_EVERY": "3"})
    assert cfg.sample_every == 3
    assert cfg.nvtx is True


# -- configure(): explicit argument beats the environment ---------------------------------------
def test_configure_argument_beats_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PERFSDK_SAMPLE_EVERY", "5")
    monkeypatch.setenv("PERFSDK_NVTX", "0")
    monkeypatch.setenv("PERFSDK_SERVICE_NAME", "env-name")
    monkeypatch.setenv("PERFSDK_EXPORT_TIMEOUT", "9")
    monkeypatch.setenv("PERFSDK_OUTPUT_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("PERFSDK_ENABLED", "0")
    from_env = config.reset_from_env()
    assert (from_env.sample_every, from_env.nvtx, from_env.service_name) == (5, False, "env-name")
    assert from_env.enabled is False

    cfg = configure(sample_every=2, nvtx=True, service_name="arg-name", export_timeout_s=1.5,
                    output_dir=tmp_path / "arg", enabled=True)
    assert cfg == get_config()
    assert cfg.sample_every == 2
    assert cfg.nvtx is True
    assert cfg.service_name == "arg-name"
    assert cfg.export_timeout_s == 1.5
    assert cfg.output_dir == tmp_path / "arg"
    assert cfg.enabled is True
    # the hot-path flags follow
    assert (config.state.enabled, config.state.nvtx, config.state.sample_every) == (True, True, 2)


def test_configure_keeps_what_it_is_not_given():
    before = configure(sample_every=3)
    after = configure(service_name="other")
    assert after.sample_every == 3
    assert after == Config(**{**before.__dict__, "service_name": "other"})


class StubSpanSink:
    """Stands in for perfsdk's span sink: these tests change settings, they export nothing (a
    real console/file exporter would install a process-wide TracerProvider)."""

    def __init__(self):
        self.configured = []

    def configure(self, config, timeout=None):
        self.configured.append(config.exporters)

    def validate(self):
        pass

    def prepare(self):
        pass


@pytest.fixture
def stub_spans(monkeypatch):
    stub = StubSpanSink()
    monkeypatch.setattr(perfsdk.lifecycle, "SPANS", stub)
    return stub


@pytest.mark.parametrize(
    ("value", "expected"),
    [("none", ()), (["console", "file"], ("console", "file")), (("file",), ("file",)),
     ("console,file", ("console", "file")), (" OTLP ", ("otlp",))],
)
def test_configure_exporter_forms(value, expected, stub_spans):
    assert configure(exporter=value).exporters == expected
    assert stub_spans.configured == ([expected] if expected else [])  # only on a change


def test_configure_exporter_beats_environment(monkeypatch, stub_spans):
    monkeypatch.setenv("PERFSDK_EXPORTER", "file")
    assert config.reset_from_env().exporters == ("file",)
    assert configure(exporter="console").exporters == ("console",)
    assert configure(exporter="none").exporters == ()
    assert stub_spans.configured == [("file",), ("console",), ()]


def test_reset_from_env_forgets_configure(monkeypatch):
    monkeypatch.setenv("PERFSDK_SAMPLE_EVERY", "6")
    configure(sample_every=2)
    assert config.reset_from_env().sample_every == 6
    assert config.state.sample_every == 6


@pytest.mark.parametrize(
    ("kwargs", "argument", "accepted"),
    [
        ({"enabled": "yes"}, "enabled", "True or False"),
        ({"enabled": 1}, "enabled", "True or False"),
        ({"nvtx": None}, "nvtx", "True or False"),
        ({"exporter": "jaeger"}, "exporter", "otlp, console, file, none"),
        ({"exporter": ["otlp", "zipkin"]}, "exporter", "otlp, console, file, none"),
        ({"exporter": ""}, "exporter", "otlp, console, file, none"),
        ({"exporter": "none,console"}, "exporter", "'none' cannot be combined"),
        ({"sample_every": 0}, "sample_every", "integers from 1 to"),
        ({"sync_guard": "loud"}, "sync_guard", "'off', 'count', 'warn', 'error'"),
        ({"sample_every": -3}, "sample_every", "integers from 1 to"),
        ({"sample_every": True}, "sample_every", "integers from 1 to"),
        ({"sample_every": "many"}, "sample_every", "integers from 1 to"),
        ({"service_name": ""}, "service_name", "non-empty strings"),
        ({"service_name": 42}, "service_name", "non-empty strings"),
        ({"export_timeout_s": 0}, "export_timeout_s", "seconds > 0"),
        ({"export_timeout_s": False}, "export_timeout_s", "seconds > 0"),
        ({"export_timeout_s": "x"}, "export_timeout_s", "seconds > 0"),
        ({"export_timeout_s": float("inf")}, "export_timeout_s", "<= 86400 (a day)"),
        ({"export_timeout_s": float("nan")}, "export_timeout_s", "<= 86400 (a day)"),
        ({"export_timeout_s": 1e12}, "export_timeout_s", "<= 86400 (a day)"),
        ({"export_timeout_s": -1}, "export_timeout_s", "seconds > 0"),
        ({"gpu_sample_interval_s": float("inf")}, "gpu_sample_interval_s", "86400 (a day)"),
        ({"export_queue_size": 0}, "export_queue_size", "integers from 1 to 1,000,000"),
        ({"export_queue_size": 2.5}, "export_queue_size", "integers from 1 to 1,000,000"),
        ({"export_batch_size": 10**7}, "export_batch_size", "integers from 1 to 1,000,000"),
        ({"export_delay_s": -1}, "export_delay_s", "seconds from 0 to 86400"),
        ({"export_batch_timeout_s": float("inf")}, "export_batch_timeout_s", "<= 86400"),
        ({"export_backoff_min_s": 0}, "export_backoff_min_s", "seconds > 0"),
        ({"export_backoff_max_s": float("nan")}, "export_backoff_max_s", "<= 86400"),
        ({"trace_max_regions": 0}, "trace_max_regions", "integers from 1 to"),
        # Settings that must agree: a batch larger than the queue, a maximum rest below the
        # minimum.
        ({"export_queue_size": 100, "export_batch_size": 200}, "export_batch_size",
         "batch sizes from 1 to the queue size"),
        ({"export_backoff_min_s": 5, "export_backoff_max_s": 1}, "export_backoff_max_s",
         "a maximum >= the minimum"),
    ],
)
def test_bad_configure_argument_raises_naming_it(kwargs, argument, accepted):
    before = get_config()
    with pytest.raises(ValueError, match=argument) as info:
        configure(**kwargs)
    assert accepted in str(info.value)
    assert f"{argument}=" in str(info.value)
    assert get_config() is before  # nothing changed


def test_batch_queue_and_delay_from_the_otel_bsp_variables():
    config = Config.from_env({"OTEL_BSP_MAX_QUEUE_SIZE": "100", "OTEL_BSP_SCHEDULE_DELAY": "250",
                              "OTEL_BSP_EXPORT_TIMEOUT": "1500",
                              "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "40"})
    assert (config.export_queue_size, config.export_batch_size) == (100, 40)
    assert config.export_delay_s == 0.25
    assert config.batch_timeout_s == 1.5
    assert Config.from_env({}).batch_timeout_s == Config().export_timeout_s


def test_queue_smaller_than_the_default_batch_clamps_the_batch():
    assert Config.from_env({"OTEL_BSP_MAX_QUEUE_SIZE": "100"}).export_batch_size == 100
    assert configure(export_queue_size=64).export_batch_size == 64
    with pytest.warns(PerfSDKWarning, match="OTEL_BSP_MAX_EXPORT_BATCH_SIZE=500 is larger"):
        config = Config.from_env({"OTEL_BSP_MAX_QUEUE_SIZE": "100",
                                  "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "500"})
    assert config.export_batch_size == 100


def test_bad_values_never_reach_flush_or_exit(tmp_path):
    """PERFSDK_EXPORT_TIMEOUT=inf used to raise OverflowError from flush() and at exit."""
    script = tmp_path / "app.py"
    script.write_text(
        "import perfsdk\n"
        "with perfsdk.timed_region('work'):\n    pass\n"
        "perfsdk.flush()\n"
        "print('ok', perfsdk.get_config().export_timeout_s)\n")
    env = {**os.environ, "PERFSDK_EXPORT_TIMEOUT": "inf", "OTEL_BSP_SCHEDULE_DELAY": "nan"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok", "5.0"]
    assert "PERFSDK_EXPORT_TIMEOUT='inf'" in done.stderr
    assert "OTEL_BSP_SCHEDULE_DELAY='nan'" in done.stderr
    assert "OverflowError" not in done.stderr


def test_configure_is_keyword_only():
    with pytest.raises(TypeError):
        configure(False)  # type: ignore[misc]


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        get_config().enabled = False  # type: ignore[misc]


def test_every_variable_is_a_documented_constant():
    names = [n for n in config.__all__ if n.startswith("PERFSDK_")]
    assert sorted(names) == sorted([
        "PERFSDK_ENABLED", "PERFSDK_EXPORTER", "PERFSDK_OUTPUT_DIR", "PERFSDK_SAMPLE_EVERY",
        "PERFSDK_NVTX", "PERFSDK_SERVICE_NAME", "PERFSDK_EXPORT_TIMEOUT", "PERFSDK_TIMING",
        "PERFSDK_MEMORY", "PERFSDK_MEMORY_SNAPSHOTS", "PERFSDK_GPU_SAMPLE_INTERVAL",
        "PERFSDK_SYNC_GUARD", "PERFSDK_EXPORT_BACKOFF_MIN", "PERFSDK_EXPORT_BACKOFF_MAX",
        "PERFSDK_TRACE_MAX_REGIONS", "PERFSDK_DISABLE_EXTENSIONS", "PERFSDK_PEAK_FLOPS",
    ])
    otel = [n for n in config.__all__ if n.startswith("OTEL_")]
    assert sorted(otel) == ["OTEL_BSP_EXPORT_TIMEOUT", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
                            "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_SCHEDULE_DELAY"]
    for name in names:
        assert getattr(config, name) == name
