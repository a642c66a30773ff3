"""Which worker programs count as validated backends (contract.text; ADR 0012)."""

from __future__ import annotations

import pytest

from contract.text import VALIDATED_TEXT_BRIDGES, is_validated_bridge, validated_bridge_name

URL = "https://github.com/db0/AI-Horde-Worker"


@pytest.mark.parametrize(
    ("bridge_agent", "validated"),
    [
        # upstream's validated LLM backends, by program name with its ~engine suffix
        (f"AI Horde Worker:24:{URL}", True),
        (f"AI Horde Worker~aphrodite~kai:24:{URL}", True),
        (f"AI Horde Worker~aphrodite~oai:24:{URL}", True),
        ("KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp", True),
        ("TabbyAPI:0.0.1:https://github.com/theroyallab/tabbyAPI", True),
        ("horde-bridge:1:https://example.invalid", True),  # this project's reference worker
        ("AI Horde Worker reGen:9.0.2:https://github.com/Haidra-Org/horde-worker-reGen", True),  # upstream's official
        # the scribe in front of an unknown KoboldAI backend, or an OpenAI one, is not vouched for
        (f"AI Horde Worker~unknown~kai:24:{URL}", False),
        (f"AI Horde Worker~oai:24:{URL}", False),
        (f"AI Horde Worker~kai~kai~kai:24:{URL}", False),
        # a config reload appends "~kai" again: still the same program and backend
        (f"AI Horde Worker~aphrodite~kai~kai:24:{URL}", True),
        (f"AI Horde Worker~aphrodite~kai~kai~kai~kai:24:{URL}", True),
        (f"AI Horde Worker~unknown~kai~kai:24:{URL}", False),
        # near misses are not collapsed into a listed name
        (f"AI Horde Worker~aphrodite~kai~kaix:24:{URL}", False),
        (f"AI Horde Worker~aphrodite:24:{URL}", False),
        ("my-own-bridge:1:x", False),
        ("", False),
    ],
)
def test_validated_programs(bridge_agent, validated):
    assert is_validated_bridge(bridge_agent) is validated


def test_collapsing_only_removes_repeated_segments():
    assert validated_bridge_name("AI Horde Worker~aphrodite~kai~kai~kai:24:x") == "AI Horde Worker~aphrodite~kai"
    assert validated_bridge_name("AI Horde Worker~kai~aphrodite~kai:24:x") == "AI Horde Worker~kai~aphrodite~kai"
    assert all(validated_bridge_name(f"{name}:1:x") == name for name in VALIDATED_TEXT_BRIDGES)
