"""Throughput of a training loop of one's own: FLOPs per optimizer step with every loop
counted, samples (and tokens) per second, MFU against a given peak, the learning rate of
any optax schedule, metrics read with one host transfer per step, and the usual trackers.

``step_flops(step, state, batch)`` counts the step's matmul and convolution FLOPs from its
traced program (``TrainStep.trace``), each loop times its length (XLA's ``cost_analysis``
counts a loop's body once: the micro-batch loop K times too low). ``Meter`` turns each
step's metrics into host numbers and rates; ``Trackers(log_with=[...])`` writes them to
TensorBoard and Weights & Biases, as HF Accelerate's ``log_with`` does; ``Progress`` draws
a tqdm bar over the steps on a terminal (none in a log file or CI). Everything not
re-exported here is private.
"""

from ._flops import step_flops as step_flops
from ._meter import Meter as Meter
from ._progress import Progress as Progress
from ._trackers import Trackers as Trackers

__all__ = ["Meter", "Progress", "Trackers", "step_flops"]
