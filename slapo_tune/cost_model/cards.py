"""Precomputed shapes of the model presets, so that ``plan`` answers without building a model.

Finding a layout builds a two-block copy of the model on the meta device, and loading a preset's
config imports transformers: together most of ``plan``'s time for a 70B model. A preset's card
holds the config fields the planner reads and its :class:`ModelLayout`, computed once by
``python -m slapo_tune.cost_model.cards`` (a test checks every card against a fresh computation).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .._atomic import atomic_write_text
from ..models import preset_names
from ..problem import ProblemSpec
from .analytic import ModelLayout, layout_of

CARDS_FILE = Path(__file__).with_name("preset_cards.json")
CONFIG_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim")


def compute_card(name: str) -> dict[str, Any]:
    """A preset's card, computed from its config and a meta-device build."""
    problem = ProblemSpec(name, 1).resolve()  # the sizes and the template are those of any world size
    config, info = problem.config, problem.info
    fields = {k: getattr(config, k, None) for k in CONFIG_FIELDS}
    # the planner's view: families' own spellings (n_embd, ffn_dim, ...) resolved once
    fields.update(hidden_size=info.hidden, num_attention_heads=info.heads, num_key_value_heads=info.kv_heads,
                  intermediate_size=info.intermediate, vocab_size=info.vocab, num_hidden_layers=info.layers)
    layout = layout_of(config, problem.template)
    return {"config": fields, "layout": dataclasses.asdict(layout)}


def preset_card(name: str) -> tuple[SimpleNamespace, ModelLayout] | None:
    """(config view, layout) of a preset from the shipped cards; None for anything else."""
    try:
        cards = json.loads(CARDS_FILE.read_text())
    except FileNotFoundError:
        return None
    card = cards.get(name)
    if card is None:
        return None
    return SimpleNamespace(**card["config"]), ModelLayout(**card["layout"])


def write_cards() -> Path:
    cards = {name: compute_card(name) for name in preset_names()}
    atomic_write_text(CARDS_FILE, json.dumps(cards, indent=1, sort_keys=True) + "\n")
    return CARDS_FILE


if __name__ == "__main__":
    print(f"wrote {write_cards()}")
