"""An unmodified Hugging Face Trainer script for ``perfsdk run``: a tiny BERT built from a config
(random weights, nothing downloaded), 8 samples, 4 optimizer steps of 2 micro-batches of 2
(2 epochs). Its argument is the Trainer's output directory."""

import sys

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

g = torch.Generator().manual_seed(0)
data = [{"input_ids": torch.randint(0, 50, (6,), generator=g), "labels": torch.tensor(i % 2)}
        for i in range(8)]
torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(
    vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
    intermediate_size=32, max_position_embeddings=16))
args = TrainingArguments(output_dir=sys.argv[1], max_steps=4, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, report_to=[], save_strategy="no",
                         logging_strategy="no", use_cpu=True, disable_tqdm=True,
                         dataloader_num_workers=0, seed=0)
state = Trainer(model=model, args=args, train_dataset=data).train()
print("optimizer steps:", state.global_step)
