"""``init: authors`` for ``fpmamba`` (issue 36): the weights of the static path as dr-faustus/fp-rnn starts
them. ``init_authors`` is ``FPMambaMixer.init_authors`` (fpscale/layers/fpmamba_map.py), kept apart because it
is a table of the authors' draws, cited line by line, not part of the layer's math.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def init_authors(mixer, n_layer: int) -> None:
    """``init: authors``: the weights of the static path as dr-faustus/fp-rnn starts them. Their
    ``FPMamba`` (models/fp_mamba_block.py) builds every projection as an ``nn.Linear`` (PyTorch's
    default: kaiming_uniform a = sqrt(5), i.e. U(+-1/sqrt(fan_in))), and their LM
    (models/fp_lm.py lines 151-158 and 233-239) then applies mamba_ssm's ``_init_weights``
    (state-spaces/mamba mamba_ssm/models/mixer_seq_simple.py lines 92-121), which zeroes the
    Linear biases (all but dt_proj's, marked ``_no_reinit``, line 138), draws embeddings from
    N(0, 0.02) (fpscale's too) and redraws ``out_proj`` as kaiming_uniform / sqrt(n_layer)
    (its ``n_residuals_per_layer`` is 1: the LM's second application, without the MLP count,
    is the last). So, against fpscale's N(0, init_std):
      w_in       U(+-1/sqrt(d_model))          in_proj, line 94 (bias=False)
      conv       weight and bias U(+-1/sqrt(d_conv))   nn.Conv1d's default, lines 96-105
                 (``_init_weights`` touches Linear and Embedding only)
      x_proj     U(+-1/sqrt(d_inner))          lines 114-116 (bias=False)
      dt_proj    U(+-dt_rank^-0.5)             lines 119-124 (dt_scale 1; = nn.Linear's bound);
                 dt_bias as fpscale's (lines 129-136: softplus^-1 of log-uniform [1e-3, 1e-1])
      w_out      U(+-1/sqrt(d_inner)) / sqrt(n_layer)   line 187 and _init_weights lines 113-121
      mixer x-halves  U(+-1/sqrt(fan_in)), fan_in = 2 d_inner (their one Linear of [x; y],
                 models/mixer.py lines 41 and 47 with fp_mamba_block.py lines 150-153; d_inner
                 without y feedback); the coefficient bias is ``mixer_bias_init`` (theirs 0:
                 zeroed by ``_init_weights``)
    The y-feedback weights follow ``feedback_init`` (the preset's ``linear`` is theirs), A_log,
    D and the output norm start as theirs already. The weight-norm gains are recomputed from
    the redrawn weights (``weight_norm`` builds g = ||v|| at construction, as here)."""
    def uniform(w: torch.Tensor | None, fan_in: int, scale: float = 1.0) -> None:
        if w is not None:
            w.uniform_(-fan_in ** -0.5, fan_in ** -0.5).mul_(scale)

    uniform(mixer.w_in, mixer.w_in.shape[1])
    if mixer.conv_w is not None:
        uniform(mixer.conv_w, mixer.d_conv)
        uniform(mixer.conv_b, mixer.d_conv)
    uniform(mixer.x_proj, mixer.d_inner)
    uniform(mixer.dt_proj, mixer.dt_rank)
    uniform(mixer.w_out, mixer.d_inner, n_layer ** -0.5)
    fan_in = 2 * mixer.d_inner if mixer.y_feedback else mixer.d_inner
    for name, p in mixer.mixer_params().items():
        if name.endswith("_x"):
            uniform(p, fan_in)
    mixer.reset_gains()
