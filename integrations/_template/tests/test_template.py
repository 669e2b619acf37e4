"""The template's own test (runs in CI from the checkout, without installing it): copy and
adapt; test against the real framework."""

from __future__ import annotations

import torch

import perfsdk_template
from perfsdk.testing import capture
from perfsdk_template import TemplateInstrumentor


def test_instrument_times_new_optimizers_and_uninstrument_undoes_it() -> None:
    model = torch.nn.Linear(2, 1)
    assert TemplateInstrumentor().instrument() is True
    try:
        assert TemplateInstrumentor().instrument() is False  # idempotent
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with capture() as cap:
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
        assert [r.name for r in cap.regions] == ["optimizer"]
    finally:
        TemplateInstrumentor().uninstrument()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    with capture() as cap:
        plain.step()
    assert cap.regions == []
    assert perfsdk_template.__version__
