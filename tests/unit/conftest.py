"""The unit tier's rule, enforced: a test here that starts Ray fails (it belongs in tests/integration/)."""

import sys

import pytest


@pytest.fixture(autouse=True)
def no_ray():
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail("this test started Ray: move it to tests/integration/ (tests/unit/ is pure)")
