"""One module or package per task: model + batches + loss + metrics + plots + inference.

Nothing imports these except the task registry (`xattn_jax.training.task.TASK_MODULES`), which loads
a task's module the first time its name is asked for.
"""
