"""The inputs of the old-run fixture: a byte-level BPE of 320 ids and a tiny Qwen2 with
RANDOM weights (seed 0) whose embedding has as many rows, made with tokenizers and
transformers only (no actx code), so this script keeps working whatever actx is called."""
import json, os, sys
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

out = sys.argv[1] if len(sys.argv) > 1 else "."
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator([f"the run directory {i} keeps every committed partition " * 2
                         for i in range(60)],
                        trainers.BpeTrainer(vocab_size=318, special_tokens=["<s>", "</s>"],
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
os.makedirs(f"{out}/tokenizer", exist_ok=True)
tok.save(f"{out}/tokenizer/tokenizer.json")
with open(f"{out}/tokenizer/tokenizer_config.json", "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 4096}, f)
torch.manual_seed(0)
cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2,
                               vocab_size=tok.get_vocab_size(), max_position_embeddings=4096,
                               rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                               bos_token_id=0, eos_token_id=1)
model = transformers.Qwen2ForCausalLM(cfg).eval()
model.save_pretrained(f"{out}/model")
with open(f"{out}/texts.jsonl", "w") as f:
    for i in range(12):
        f.write(json.dumps({"id": f"doc-{i}", "text": "the run directory keeps " * (i + 2)
                            + f"partition {i}."}) + "\n")
print(tok.get_vocab_size())
