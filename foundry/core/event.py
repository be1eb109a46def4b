"""Every point in the run where algorithms and callbacks may act, in the order they fire.

The whole loop, with each event in place (``Trainer.fit``)::

    INIT                                  # components built; before the model is placed/sharded and loaded
    AFTER_LOAD                            # load_path / autoresume applied
    FIT_START
    if eval_first: EVAL_START ... EVAL_END
    for epoch in range(...):
        EPOCH_START
        while True:
            BEFORE_DATALOADER
            batch = next(dataloader_iter)     # StopIteration ends the epoch
            AFTER_DATALOADER
            BATCH_START
            for microbatch in batch:
                BEFORE_FORWARD
                outputs = model(microbatch)   # through the Trainer's objective: DPO's
                AFTER_FORWARD                 #   forward runs the reference too
                BEFORE_LOSS
                loss = model.loss(outputs, microbatch)
                AFTER_LOSS
                BEFORE_BACKWARD
                loss.backward()
                AFTER_BACKWARD
            BEFORE_OPTIMIZER_STEP             # grads of the whole batch are ready (clipping lives here)
            optimizer.step()                  # skipped when a callback set state.skip_optimizer_step
            AFTER_OPTIMIZER_STEP
            scheduler.step()                  # before the timestamp counts this batch (as Composer)
            BATCH_END                         # timestamp already counts this batch
            if checkpoint is due:
                BEFORE_CHECKPOINT
                BATCH_CHECKPOINT              # fired once the checkpoint is published (save_async: later)
            if eval is due:
                EVAL_START
                for eval_batch in eval_dataloader:
                    EVAL_BATCH_START
                    EVAL_BEFORE_FORWARD
                    outputs = model(eval_batch)
                    EVAL_AFTER_FORWARD
                    EVAL_BATCH_END
                EVAL_END
            if max_duration reached: break
        EPOCH_END
        if checkpoint is due:
            BEFORE_CHECKPOINT
            EPOCH_CHECKPOINT
        if eval is due: EVAL_START ... EVAL_END
    eval and checkpoint (BATCH_CHECKPOINT) the final model unless its last batch did
    FIT_END

``Trainer.eval()`` outside ``fit`` fires the EVAL_* events alone.
"""

from __future__ import annotations

import enum


class Event(str, enum.Enum):
    INIT = "init"
    AFTER_LOAD = "after_load"
    FIT_START = "fit_start"
    EPOCH_START = "epoch_start"
    BEFORE_DATALOADER = "before_dataloader"
    AFTER_DATALOADER = "after_dataloader"
    BATCH_START = "batch_start"
    BEFORE_FORWARD = "before_forward"
    AFTER_FORWARD = "after_forward"
    BEFORE_LOSS = "before_loss"
    AFTER_LOSS = "after_loss"
    BEFORE_BACKWARD = "before_backward"
    AFTER_BACKWARD = "after_backward"
    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"
    AFTER_OPTIMIZER_STEP = "after_optimizer_step"
    BATCH_END = "batch_end"
    BEFORE_CHECKPOINT = "before_checkpoint"
    BATCH_CHECKPOINT = "batch_checkpoint"
    EPOCH_END = "epoch_end"
    EPOCH_CHECKPOINT = "epoch_checkpoint"
    FIT_END = "fit_end"
    EVAL_START = "eval_start"
    EVAL_BATCH_START = "eval_batch_start"
    EVAL_BEFORE_FORWARD = "eval_before_forward"
    EVAL_AFTER_FORWARD = "eval_after_forward"
    EVAL_BATCH_END = "eval_batch_end"
    EVAL_END = "eval_end"

    @property
    def is_eval(self) -> bool:
        return self.value.startswith("eval_")
