"""Hugging Face Mixtral and Qwen3-MoE in the pipeline: the loss and every gradient equal the model's own.

The reference is ``transformers``' own ``*ForCausalLM`` with ``output_router_logits`` (its loss is the
cross entropy plus ``router_aux_loss_coef`` x the load-balancing loss of every layer's routers) on the
same micro-batches in turn, each loss weighted by its share of the rows. The pipeline's loss plus its
auxiliary loss equals the model's (rtol 1e-5); gradients rtol 1e-4, atol 1e-6 as the other Hugging
Face tests hold them. Qwen3's case has a dense layer (``mlp_only_layers``) between two MoE layers.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from executor.config import RunConfig  # noqa: E402
from executor.models.build import checkpoint_names  # noqa: E402
from executor.models.moe_aux_loss import take_aux_loss  # noqa: E402
from executor.runtime.data import split  # noqa: E402
from executor.runtime.pipeline import LocalPipeline  # noqa: E402
from tests.helpers.moe_parity import HF_MOE_CONFIGS as CONFIGS  # noqa: E402


@pytest.mark.parametrize("family,partition,schedule,checkpoint", [
    ("mixtral", (4,), "gpipe", "never"), ("mixtral", (2, 2), "1f1b", "always"),
    ("qwen3_moe", (2, 3), "gpipe", "except_last"),
])
def test_moe_losses_and_gradients_equal_the_models_own(family, partition, schedule, checkpoint):
    options = {**CONFIGS[family], "seq": 8}
    pipe = LocalPipeline(RunConfig.of(model=f"hf:{family}", options=options, partition=partition, batch_size=6,
                                   microbatches=3, schedule=schedule, checkpoint=checkpoint))
    rename = checkpoint_names(f"hf:{family}", options)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(family, **CONFIGS[family]))
    model.load_state_dict({rename(n): v for n, v in pipe.model().state_dict().items()})
    ids, _ = pipe.batch(0)
    take_aux_loss()
    loss = pipe.run_step(0, update=False)
    aux = take_aux_loss()
    expected = 0.0
    for x in split(ids, 3):
        out = model(input_ids=x, labels=x)
        (out.loss * (x.shape[0] / ids.shape[0])).backward()
        expected += float(out.loss.detach()) * x.shape[0] / ids.shape[0]
    assert aux > 0 and loss + aux == pytest.approx(expected, rel=1e-5)
    ours = {rename(name): p for stage in pipe.stages for name, p in stage.module.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_tensor_parallelism_of_hugging_face_experts_is_one_line(capsys):
    from gpipe.main import main

    flags = [f"--option={key}={str(value).lower()}" for key, value in CONFIGS["mixtral"].items()]
    assert main(["train", "--model", "hf:mixtral", *flags, "--stages", "1", "--tensor-parallel", "2",
                 "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tensor-parallel 2 with hf:mixtral" in err, err
