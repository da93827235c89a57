"""The built-in mlp and cnn layer by layer, as the executor builds them from plain torch.nn modules.

How a layer's FLOPs, bytes and memory are counted, and what is left out: :mod:`sim.workloads.layer_spec`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sim.workloads.layer_spec import LayerSpec, weights_read
from sim.workloads.precision import FP32_BYTES, precision_of


def mlp_layers(o: dict[str, Any]) -> list[LayerSpec]:
    """``layers`` x [Linear(w, w) + ReLU] on rows of ``width`` fp32 features.

    Per row, with c the compute bytes: F = 2w^2; B = 4w*c (Linear reads w, writes w; ReLU reads w,
    writes w) + weights once; saved = w*c (Linear's input; ReLU's output is counted as the next
    layer's input). Under bf16 the first layer's fp32 input is cast (6w bytes moved) and the cast
    saved instead of the input (``saves_input`` false); every later layer's input needs a gradient,
    so its Linear also saves autocast's copy of the weight, 2w^2 bytes per micro-batch.
    """
    w, p = o["width"], precision_of(o["precision"])
    c = p.compute_bytes
    params = w * w + w
    later = LayerSpec(
        "linear_relu", params, flops_per_row=2.0 * w * w, traffic_bytes_per_row=4.0 * w * c,
        fixed_traffic_bytes=weights_read(p, params, 0), saved_bytes_per_row=w * c,
        input_bytes_per_row=w * c, output_bytes_per_row=w * c,
        fixed_saved_bytes=p.weight_copy_bytes * w * w,
    )
    # the model's input needs no gradient: its Linear saves no weight copy
    first = dataclasses.replace(later, traffic_bytes_per_row=later.traffic_bytes_per_row + p.cast_bytes * w,
                                input_bytes_per_row=w * FP32_BYTES, fixed_saved_bytes=0.0,
                                saves_input=not p.casts)
    return [first] + [later] * (o["layers"] - 1)


def cnn_layers(o: dict[str, Any]) -> list[LayerSpec]:
    """[Stem, ``layers`` x Conv-BN-ReLU, Head] on 3 x n x n fp32 images, C channels, k classes.

    Per row (image), with c the compute bytes and x the bytes of one cast (:mod:`sim.workloads.layer_spec`):

    - Stem Conv2d(3, C, 3, pad 1) + BN + ReLU: params 27C + C + 2C; F = 2*n^2*C*27;
      saved = c(3n^2 + Cn^2) (conv input, BN input; ReLU output counted by the next layer). In
      bf16 the conv saves the bf16 cast of the fp32 image, not the image (``saves_input`` false),
      and the copy of its weight, 54C bytes (a convolution keeps its weight even when its input
      needs no gradient; a Linear does not).
    - Block Conv2d(C, C, 3, pad 1) + BN + ReLU: params 9C^2 + C + 2C; F = 2*n^2*C*9C;
      saved = 2Cn^2*c [+ 18C^2 weight copy in bf16].
    - Head AdaptiveAvgPool2d(1) + Flatten + Linear(C, k): params Ck + k; F = 2Ck;
      saved = C*c (Linear's input; pooling to 1x1 runs as a mean, which saves only shapes, so the
      head keeps nothing of its own input) [+ 2Ck weight copy in bf16].
    Traffic per row: conv reads its input, writes Cn^2; BN reads twice (statistics, normalise)
    and writes once; ReLU reads and writes once; bf16 casts the image once. BN statistics per
    channel are not counted.
    """
    L, C, n, k = (o[key] for key in ("layers", "channels", "image", "classes"))
    p, area = precision_of(o["precision"]), o["image"] ** 2
    c = p.compute_bytes
    stem_params = 27 * C + C + 2 * C
    stem = LayerSpec(
        "stem", params=stem_params, flops_per_row=2.0 * area * C * 27,
        traffic_bytes_per_row=c * (3 * area + 6 * C * area) + p.cast_bytes * 3 * area,
        fixed_traffic_bytes=weights_read(p, 28 * C, 2 * C),
        saved_bytes_per_row=c * (3 * area + C * area),
        input_bytes_per_row=3 * area * FP32_BYTES, output_bytes_per_row=C * area * c,
        fixed_saved_bytes=p.weight_copy_bytes * 27 * C,  # a convolution saves its weight regardless
        saves_input=not p.casts,
    )
    block_params = 9 * C * C + C + 2 * C
    block = LayerSpec(
        "conv_bn_relu", params=block_params, flops_per_row=2.0 * area * C * 9 * C,
        traffic_bytes_per_row=7 * C * area * c, fixed_traffic_bytes=weights_read(p, 9 * C * C + C, 2 * C),
        saved_bytes_per_row=2 * C * area * c,
        input_bytes_per_row=C * area * c, output_bytes_per_row=C * area * c,
        fixed_saved_bytes=p.weight_copy_bytes * 9 * C * C,
    )
    head_params = C * k + k
    head = LayerSpec(
        "head", params=head_params, flops_per_row=2.0 * C * k,
        traffic_bytes_per_row=c * (C * area + 2 * C + k), fixed_traffic_bytes=weights_read(p, head_params, 0),
        saved_bytes_per_row=C * c,
        input_bytes_per_row=C * area * c, output_bytes_per_row=k * c,
        fixed_saved_bytes=p.weight_copy_bytes * C * k, saves_input=False,
    )
    return [stem] + [block] * L + [head]
