"""The linears the transformers backend keeps plain (models/transformers/plain_linears.py): those
the modelling code uses as more than a linear map, found in the model, not by name."""

import pytest
import torch
from torch import nn

from batchrun.models.layers import packed_linear
from batchrun.models.layers.packed_linear import PackedLinear
from batchrun.models.transformers import plain_linears
from batchrun.models.transformers.model import load
from tests.tiny_models import BACKEND_ARCHS, make_tiny


class _ReadsOnABranch(nn.Module):
    """Reads its selector's weight only for half-precision input: a float32 forward never does."""

    def __init__(self):
        super().__init__()
        self.selector, self.proj = nn.Linear(8, 4), nn.Linear(8, 8)

    def forward(self, x):
        if x.dtype == torch.float16:
            x = x.to(self.selector.weight.dtype)
        return self.proj(x) + self.selector(x).sum(-1, keepdim=True)


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _ReadsOnABranch()
        self.head = nn.Linear(8, 8)
        self.keyword = nn.Linear(8, 8)

    def forward(self, x):
        # a read two levels down, which no source of the linear's own holder shows
        scale = self.block.proj.bias.abs().mean()
        return self.head(self.block(x)) * scale + self.keyword(input=x)


def test_reads_on_untaken_branches_from_other_modules_and_keyword_calls_are_found():
    model = _Holder()
    x = torch.randn(3, 8)
    expected = model(x)
    assert plain_linears.static(model) == {"block.selector"}
    found = plain_linears.find(model, lambda: model(x))
    assert found == {"block.selector", "block.proj", "keyword"}
    # tracing leaves the model as it was
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert torch.equal(model(x), expected)


@pytest.mark.parametrize("arch,kept", [
    ("phimoe", "mlp.router"),  # an nn.Linear subclass returning (logits, weights, experts)
    ("hunyuan_v1_moe", "mlp.gate.wg")])  # its gate reads wg.weight.dtype
def test_routers_the_modelling_code_uses_directly_stay_plain_and_the_rest_is_packed(arch, kept,
                                                                                   tmp_path):
    hf = make_tiny(arch, tmp_path, archs=BACKEND_ARCHS)
    model = load(tmp_path, torch.device("cpu"), torch.float32)
    layers = hf.config.num_hidden_layers
    assert model.plain_linears == {f"model.layers.{i}.{kept}" for i in range(layers)}
    for name in model.plain_linears:
        assert type(model.hf.get_submodule(name)) is type(hf.get_submodule(name))
    if packed_linear.available(torch.float32):
        others = [n for n, m in hf.named_modules() if isinstance(m, nn.Linear)
                  and n not in model.plain_linears]
        assert others and all(isinstance(model.hf.get_submodule(n), PackedLinear) for n in others)
