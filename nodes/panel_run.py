"""One sampling run as the panel keeps it: where the run is, and the steps it ran, for its timeline."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..offload import StepTimeline

# What the downloadable timeline of one run may hold (block calls in all its steps): ~30 MB at most.
MAX_RUN_SPANS = 200_000


@dataclass
class RunRecord:
    """One run of an engine: one sampling call (``run_started`` .. ``run_finished``), or, when a sampler calls
    the model without ComfyUI's ``pre_run``, everything since the engine started.

    Written on the sampling thread; the routes read it from the server's thread. A new run gets a new record,
    and ``steps`` is only appended to: a route may still be reading the last run's list.
    """

    prompt_id: str | None = None
    resident_weights: int | None = None  # the bytes ComfyUI loaded of the model as the run started
    running: bool = False
    first_step: int | None = None  # the recorder's index of the run's first step, recorded or not
    step: int | None = None  # the recorder's index of the step running now
    block: int | None = None
    steps: list[StepTimeline] = field(default_factory=list)  # the steps kept, up to MAX_RUN_SPANS block calls
    last_step: StepTimeline | None = None
    steps_done: int = 0
    truncated: bool = False  # a step was left out of ``steps``
    spans: int = 0  # block calls in every step recorded

    def record(self, step: StepTimeline) -> bool:
        """Keeps a step the recorder resolved; False for the end of an earlier run, resolved late."""
        if self.first_step is None or step.step < self.first_step:
            return False
        self.steps_done = step.step - self.first_step + 1  # the steps between recorded ones ran too
        self.spans += len(step.spans)
        if self.spans <= MAX_RUN_SPANS:
            self.steps.append(step)
        else:
            self.truncated = True
        self.last_step = step
        return True
