"""Config: explicit argument > PERFSDK_* variable > default; bad values are named."""

from __future__ import annotations

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
        ("PERFSDK_SAMPLE_EVERY", "0", "sample_every", "integers >= 1"),
        ("PERFSDK_SAMPLE_EVERY", "2.5", "sample_every", "integers >= 1"),
        ("PERFSDK_NVTX", "2", "nvtx", "1/0, true/false"),
        ("PERFSDK_SYNC_GUARD", "strict", "sync_guard", "'off', 'count', 'warn', 'error'"),
        ("PERFSDK_EXPORT_TIMEOUT", "-1", "export_timeout_s", "seconds > 0"),
        ("PERFSDK_EXPORT_TIMEOUT", "soon", "export_timeout_s", "seconds > 0"),
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
        ({"sample_every": 0}, "sample_every", "integers >= 1"),
        ({"sync_guard": "loud"}, "sync_guard", "'off', 'count', 'warn', 'error'"),
        ({"sample_every": -3}, "sample_every", "integers >= 1"),
        ({"sample_every": True}, "sample_every", "integers >= 1"),
        ({"sample_every": "many"}, "sample_every", "integers >= 1"),
        ({"service_name": ""}, "service_name", "non-empty strings"),
        ({"service_name": 42}, "service_name", "non-empty strings"),
        ({"export_timeout_s": 0}, "export_timeout_s", "seconds > 0"),
        ({"export_timeout_s": False}, "export_timeout_s", "seconds > 0"),
        ({"export_timeout_s": "x"}, "export_timeout_s", "seconds > 0"),
    ],
)
def test_bad_configure_argument_raises_naming_it(kwargs, argument, accepted):
    before = get_config()
    with pytest.raises(ValueError, match=argument) as info:
        configure(**kwargs)
    assert accepted in str(info.value)
    assert f"{argument}=" in str(info.value)
    assert get_config() is before  # nothing changed


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
        "PERFSDK_SYNC_GUARD",
    ])
    for name in names:
        assert getattr(config, name) == name
