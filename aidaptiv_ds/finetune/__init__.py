"""The fine-tuning application behind ``launch/finetune.py`` (one job per module).

* :mod:`.data`: Dolly JSONL reading/validation, ``--category`` filter, deterministic train/eval split;
* :mod:`.template`: prompt template (the tokenizer's chat template, else ``### Instruction`` sections),
  labels -100 on prompt and padding, truncation;
* :mod:`.model_io`: load an HF directory / ``.gguf`` file / hub id, save the fine-tuned HF directory;
* :mod:`.demo`: the embedded offline data set and tiny Llama;
* :mod:`.ds_config`: the DeepSpeed JSON config filled from the command line;
* :mod:`.distributed`: single-process defaults and cross-rank reductions;
* :mod:`.evaluate`: token-weighted held-out loss, also for a saved model;
* :mod:`.loop`: the DeepSpeed training loop;
* :mod:`.job`: one run end to end (:func:`.job.run`).
"""
