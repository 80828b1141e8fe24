"""A transformers Trainer run on a tiny BERT built from a config (no downloads), on CPU
processes (DDP over gloo), under ddprun and under torchrun with the same flags
(tests/gpu/device/run.sh). Checks the Trainer's world size and steps, and that every rank ends with
the same weights. Rank 0 prints one JSON line."""
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

t0 = time.monotonic()
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])


class Tiny(torch.utils.data.Dataset):
    def __init__(self, n=256):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(5, 100, (n, 16), generator=g)
        self.labels = (self.ids[:, 0] % 2).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(16, dtype=torch.long),
                "labels": self.labels[i]}


torch.manual_seed(0)
config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=32, num_labels=2)
model = BertForSequenceClassification(config)
out_dir = tempfile.mkdtemp(prefix="ddprun-trainer-")
args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=8, max_steps=12, learning_rate=1e-3,
                         logging_steps=4, save_strategy="no", report_to="none", use_cpu=True,
                         ddp_backend="gloo", disable_tqdm=True, dataloader_num_workers=0, seed=0)
trainer = Trainer(model=model, args=args, train_dataset=Tiny())
result = trainer.train()
flat = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
agree = all(torch.equal(gathered[0], g) for g in gathered)
ok = args.world_size == world and args.process_index == rank and trainer.state.global_step == 12 and agree
if rank == 0 or not ok:
    print(json.dumps({"ok": ok, "world_size": args.world_size, "global_step": trainer.state.global_step,
                      "train_loss": round(result.training_loss, 4), "weights_agree": agree,
                      "train_s": round(time.monotonic() - t0, 2)}), flush=True)
sys.exit(0 if ok else 1)
