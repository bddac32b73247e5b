import sys
from pathlib import Path

import pytest

from tests.fixtures import build_tiny_fuyu, build_tiny_llava

# The demo scene generator (tools/demo_data.py) and the example scenes (examples/make_example_images.py)
# give the expected answers of the demo-model tests.
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tools"), str(REPO / "examples")]


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("tiny_llava"))


@pytest.fixture(scope="session")
def tiny_fuyu_dir(tmp_path_factory):
    return build_tiny_fuyu(tmp_path_factory.mktemp("tiny_fuyu"))
