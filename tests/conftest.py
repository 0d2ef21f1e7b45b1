"""Fixtures: the tiny random models most tests share (builders in tests/helpers.py)."""

import signal

import pytest
import torch

from tests.helpers import noisy_copy, tiny_model

torch.set_num_threads(1)  # tiny models: threading costs more than it saves, and CI has two cores
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # a shell's background job starts so, and children inherit it
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the Ctrl-C tests need Ctrl-C to arrive


@pytest.fixture(scope="session")
def target_model():
    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def small_drafter_model():
    """Shares the target's vocabulary, smaller and differently initialised: partly accepted."""
    return tiny_model(seed=1, layers=1, hidden=16)


@pytest.fixture(scope="session")
def noisy_copy_model(target_model):
    """The target with perturbed output weights: agrees often, not always."""
    return noisy_copy(target_model)


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory):
    """The converted-model cache for the whole run: real models are converted once, never into the user's cache."""
    return tmp_path_factory.mktemp("specchat-cache")


@pytest.fixture(scope="session", autouse=True)
def no_user_cache_dir(tmp_path_factory):
    """Whatever a test runs (the chat's history, calibrations, subprocesses) writes under a temporary cache dir,
    never into the user's ~/.cache/specchat."""
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    yield
    patch.undo()
