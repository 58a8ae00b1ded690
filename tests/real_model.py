"""The real pretrained model for tests: fetched and converted once into the default cache
(the first test that needs it does it, ~30 s, as ``asyncrl models get`` would; CI runs
only the README's test command), skipped with the reason when the registry cannot be
reached or ``gguf`` is missing; a conversion that goes wrong fails instead.

Use: ``from real_model import smollm2_dir  # noqa: F401 (a fixture)``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.model_convert import MissingExtraError, RegistryUnreachable, ensure_model

SMOLLM2 = "smollm2-135m-instruct"


def smollm2_path() -> Path:
    try:
        return ensure_model(SMOLLM2)
    except (RegistryUnreachable, MissingExtraError) as exc:
        pytest.skip(f"{SMOLLM2} is not available: {exc}")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The SmolLM2-135M-Instruct Hugging Face directory (a session's skip is remembered, not retried)."""
    return smollm2_path()
