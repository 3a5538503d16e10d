"""fpscale models as Hugging Face transformers models: ``launch/convert.py --to hf`` writes a folder
that ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads (fpscale.hf.export).

    configuration_fpscale   FpscaleConfig: the fpscale model and solver sections, the evaluation depth
    modeling_fpscale        FpscaleForCausalLM: LoopedLM behind the transformers interface (cache,
                            left padding with an attention mask, generate())
    tokenization_fpscale    FpscaleTokenizer: the SentencePiece model, token for token as fpscale's
    export                  writes the folder: these three files and fpscale's model code, bundled

The three model-side files import only fpscale.models, fpscale.solvers and the base modules; the
export copies exactly those modules beside them (imports made relative), so the folder loads
where fpscale is not installed. Needs transformers (pip install "fpscale[hf]").
"""
