"""A rank of one's own script under another launcher than ``jaxdp launch`` (issue 43, item
6): started as ``mpirun``/``srun`` start it, through ``jaxdp run``, a rank that raises ends
at once with its own status, before the peer that waits for it in a collective; without
it, the rank would sit in JAX's shutdown barrier for ``timeout_s`` and end after its peer.
"""

import os
import subprocess
import sys
import threading
import time

from helpers import reserved_port

SCRIPT = """
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxdp

mesh = jaxdp.initialize()  # the run's settings from the environment, as a launcher sets them
if jax.process_index() == 1:
    raise ValueError("a bug on rank 1")
rows = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), np.ones(1))
print(jax.jit(lambda a: a.sum())(rows))  # waits for rank 1, which never comes
"""


def test_a_rank_that_raises_under_another_launcher_ends_first_with_its_status(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    with reserved_port() as port:
        ranks = [
            subprocess.Popen(
                [sys.executable, "-m", "jaxdp", "run", str(script)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={
                    **os.environ,
                    "JAXDP_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                    "JAXDP_NUM_PROCESSES": "2",
                    "JAXDP_PROCESS_ID": str(i),
                    "JAXDP_CPU_DEVICES": "1",
                    "JAXDP_TIMEOUT_S": "60",  # JAX's shutdown barrier would hold rank 1 this long
                    "JAXDP_HEARTBEAT_TIMEOUT_S": "5",  # rank 0 ends when rank 1's beats stop
                },
            )
            for i in (0, 1)
        ]
        stopper = threading.Timer(150, lambda: [r.kill() for r in ranks])
        stopper.start()
        try:
            order = []
            while len(order) < 2:
                order += [i for i, r in enumerate(ranks) if i not in order and r.poll() is not None]
                time.sleep(0.05)
            outputs = [r.communicate() for r in ranks]
        finally:
            stopper.cancel()
    assert order[0] == 1, outputs  # the failing rank ended first, not in the barrier
    assert ranks[1].returncode == 1, outputs[1]
    err = outputs[1][1]
    assert "ValueError: a bug on rank 1" in err
    assert "jaxdp: process 1 ends on this ValueError at once" in err
    assert ranks[0].returncode != 0  # its collective could not complete
