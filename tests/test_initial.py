"""A node's model made at its seed's initial weights on its device, one weight at a time (`model.initial`)."""

import dataclasses

import pytest
import torch
from live_bytes import LiveBytes

from spes_node.config import load_preset
from spes_node.model.initial import initial_model
from spes_node.model.moe import MoEForCausalLM
from spes_node.model.ownership import apply_ownership

TINY = load_preset("tiny").model
SMALL = load_preset("small").model


def _storage_bytes(model: torch.nn.Module) -> int:
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()
    }
    return sum(storages.values())


@pytest.mark.parametrize("frozen_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("owned", [None, [1], [0, 3]])
@pytest.mark.parametrize("tied", [False, True])
def test_the_weights_are_the_seeds_whatever_the_ownership(frozen_dtype, owned, tied):
    cfg = dataclasses.replace(TINY, tie_embeddings=True) if tied else TINY
    made = initial_model(cfg, 4, 11, owned=owned, frozen_dtype=frozen_dtype)
    built = MoEForCausalLM(cfg, 4, seed=11)
    if owned is not None:
        apply_ownership(built, owned, frozen_dtype)
    ours, theirs = made.state_dict(), built.state_dict()
    assert list(ours) == list(theirs)
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
    assert [n for n, p in made.named_parameters()] == [n for n, p in built.named_parameters()]
    assert all(p.requires_grad for p in made.parameters())
    assert (made.lm_head.weight is made.model.embed_tokens.weight) == tied
    # another seed, other weights; the seed's, not the global generator's
    torch.manual_seed(0)
    other = initial_model(cfg, 4, 12, owned=owned, frozen_dtype=frozen_dtype)
    assert not torch.equal(other.lm_head.weight, made.lm_head.weight)


@pytest.mark.parametrize("frozen_dtype", ["bf16", "int8"])
def test_making_the_model_holds_one_weight_at_a_time_beside_it(frozen_dtype):
    """The model as it will be stored, plus one weight drawn in fp32 and, for a frozen one, its stored form (int8's
    rounding temporaries too); building it whole in fp32 and freezing after held the frozen shards in fp32 too."""
    cfg, owned = SMALL, [0]
    with torch.device("meta"):
        layout = MoEForCausalLM(cfg, 4)
    largest = 4 * max(p.numel() for p in layout.parameters())
    whole_fp32 = 4 * sum(p.numel() for p in layout.parameters())

    with LiveBytes() as live:
        model = initial_model(cfg, 4, 3, owned=owned, frozen_dtype=frozen_dtype)
    stored = _storage_bytes(model)
    assert live.now == stored
    # bf16: the fp32 weight and its bf16 form; int8: the weight, its scaled copy, the int8 form and the row scales
    bound = (1.5 if frozen_dtype == "bf16" else 2.5) * largest
    assert live.peak - stored <= bound, f"{(live.peak - stored) / largest:.2f} fp32 weights beside the model"

    with LiveBytes() as live:
        built = MoEForCausalLM(cfg, 4, seed=3)
        apply_ownership(built, owned, frozen_dtype)
    assert _storage_bytes(built) == stored
    assert live.peak >= whole_fp32 > stored + bound, "building it whole held the whole model in fp32"
