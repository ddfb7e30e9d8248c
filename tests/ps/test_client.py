"""PSClient argument checking and lifecycle, against a real 1-worker job started by the test."""

from __future__ import annotations

import numpy as np
import pytest

from tagps.ps import PSClient


@pytest.mark.timeout(60)
def test_client_rejects_bad_arguments_with_clear_errors(ps_job) -> None:
    with ps_job(num_workers=1, num_servers=1) as job:
        client = PSClient(job.client_config(0))
        try:
            client.declare("f", 40, np.float32)
            client.declare("i", 16, np.int64)
            client.declare("empty", 0, np.float16)
            with pytest.raises(ValueError, match="already declared"):
                client.declare("f", 40, np.float32)
            with pytest.raises(ValueError, match="multiple of 4"):
                client.declare("g", 41, np.float32)
            with pytest.raises(TypeError, match="integer"):
                client.declare("g", 40.0, np.float32)
            with pytest.raises(TypeError, match="not supported"):
                client.declare("g", 40, np.complex64)
            with pytest.raises(ValueError, match="init for 'g'"):
                client.declare("g", 40, np.float32, init=np.zeros(3, np.float32))
            with pytest.raises(ValueError, match="more than 65536"):
                client.declare("huge", (1 << 16) * job.client_config(0).partition_bytes + 4, np.float32)
            client.barrier()

            with pytest.raises(ValueError, match="not declared"):
                client.push_pull("nope", np.zeros(10, np.float32))
            with pytest.raises(TypeError, match="dtype float64, declared float32"):
                client.push_pull("f", np.zeros(10, np.float64))
            with pytest.raises(ValueError, match="40 bytes"):
                client.push_pull("f", np.zeros(20, np.float32)[::2])
            with pytest.raises(TypeError, match="floating dtype"):
                client.push_pull("i", np.zeros(2, np.int64))
            assert client.poll(client.push_pull("empty", np.zeros(0, np.float16)))

            buf = np.arange(10, dtype=np.float32)
            handle = client.push_pull("f", buf)
            with pytest.raises(ValueError, match="has not completed"):
                client.push_pull("f", buf)
            client.wait(handle, timeout=20)
            np.testing.assert_array_equal(buf, np.arange(10, dtype=np.float32))  # one worker: mean = own

            ints = np.array([1, 2], np.int64)
            client.wait(client.push_pull("i", ints, average=False), timeout=20)
            np.testing.assert_array_equal(ints, [1, 2])
            with pytest.raises(ValueError, match="not a handle of this PSClient"):
                client.wait(object())  # type: ignore[arg-type]
        finally:
            client.close()
            client.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            client.push_pull("f", np.zeros(10, np.float32))
        assert job.wait_infrastructure() == {"scheduler": 0, "server0": 0}
