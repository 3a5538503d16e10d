"""The command-line entry points (``fpscale-pretrain``, ``fpscale-evaluate``, ``fpscale-convert``,
``fpscale-generate``); launch/*.py run the same ``main`` as scripts."""
