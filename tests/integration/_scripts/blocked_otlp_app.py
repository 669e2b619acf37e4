"""perfsdk without the OTLP exporter package: a meta-path finder hides it from this process.

Run as ``python blocked_otlp_app.py RESULT_JSON configure|env``. ``configure`` calls
``perfsdk.configure(exporter="otlp")`` under each OTLP protocol and records what it raised;
``env`` relies on ``PERFSDK_EXPORTER=otlp`` from the environment. Either way it then runs a
region and writes a JSON result.
"""

import importlib.abc
import json
import os
import sys

BLOCKED = "opentelemetry.exporter.otlp"


class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == BLOCKED or name.startswith(BLOCKED + "."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, _Block())
for _name in [m for m in sys.modules if m == BLOCKED or m.startswith(BLOCKED + ".")]:
    del sys.modules[_name]

import perfsdk  # noqa: E402


@perfsdk.profiled("work")
def work(x: int) -> int:
    return x + 1


def main() -> None:
    result_path, how = sys.argv[1], sys.argv[2]
    out: dict[str, object] = {}
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    except ImportError:
        out["blocked"] = True
    else:
        out["blocked"] = False
    if how == "configure":
        raised = {}
        for protocol in ("http/protobuf", "grpc"):
            os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = protocol
            try:
                perfsdk.configure(exporter="otlp")
            except Exception as exc:
                raised[protocol] = {
                    "type": type(exc).__name__,
                    "missing_dependency": isinstance(exc, perfsdk.MissingDependencyError),
                    "import_error": isinstance(exc, ImportError),
                    "message": str(exc),
                }
            else:
                raised[protocol] = None
        out["raised"] = raised
        out["exporters_after"] = list(perfsdk.get_config().exporters)
    out["value"] = work(41)
    perfsdk.flush()
    out["diagnostics"] = perfsdk.diagnostics()
    with open(result_path, "w", encoding="utf-8") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
