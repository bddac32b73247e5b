import pytest

from testkit import build_tiny_fuyu, build_tiny_llava


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("tiny_llava"))


@pytest.fixture(scope="session")
def tiny_fuyu_dir(tmp_path_factory):
    return build_tiny_fuyu(tmp_path_factory.mktemp("tiny_fuyu"))
