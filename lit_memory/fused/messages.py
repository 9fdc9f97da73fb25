"""The fused step's refusals: one line each, what cannot work (fusion never sees the gradients after backward)
and what to do instead."""

ACCUMULATION = (
    "the fused step updates the parameters in every backward, so it cannot accumulate gradients: set "
    "trainer.accumulate_grad_batches to 1 (fit the batch with model.gradient_checkpointing) "
    "or remove the fused strategy"
)
ACCUMULATION_SCHEDULE = (
    "the fused step updates the parameters in every backward, so it cannot accumulate gradients: remove the "
    "GradientAccumulationScheduler callback (or keep its factors at 1), or remove the fused strategy"
)
CLIPPING_HOOK = (
    "the fused step applies each gradient as soon as backward produces it, so the module's "
    "configure_gradient_clipping finds no gradient to clip: remove that override (trainer.gradient_clip_val "
    "and gradient_clip_algorithm clip inside the fused step), or remove the fused strategy"
)
UNMEASURED = (
    "clipping by norm under the fused step needs the global norm before the first bucket steps, which only "
    "a backward that measures it first can give: call backward through the fused strategy or fabric.backward(loss), "
    "not loss.backward()"
)
UNSCALED = (
    "fp16 loss scaling: backward came before the loss was scaled (scaler.scale(loss)), so there is no scale to "
    "unscale the gradients by: scale the loss with the GradScaler first, as Lightning and Fabric do"
)
UNCHECKED = (
    "fp16 loss scaling under the fused step must know whether any gradient overflowed before the first bucket "
    "steps, which only a backward that checks them first can tell: call backward through the fused strategy or "
    "fabric.backward(loss), not loss.backward()"
)
MANUAL = (
    "the fused step runs the optimizer inside backward, where manual optimization cannot control it: "
    "use automatic optimization or remove the fused strategy"
)
SEVERAL = (
    "the fused step drives exactly one optimizer: put all parameters into one optimizer "
    "(parameter groups for different settings) or remove the fused strategy"
)

FABRIC_CLIPPING = (
    "fabric.clip_gradients runs after backward, when the fused step has already applied and freed every "
    "gradient: give the fused strategy (or fsdp_overlap_step_with_backward) max_norm or clip_val instead, "
    "which clip inside backward with the same results"
)
