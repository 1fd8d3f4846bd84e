"""A converted model trained by the Hugging Face ``Trainer`` and by PyTorch Lightning.

Both loops own the model from there on (device placement, gradient accumulation, optimizer,
``zero_grad``, logging); what must hold is that they train it exactly as they train the plain
model. Each loop runs twice on the same data and seed: once on the unconverted model and once
on the model converted at 8 bits (uniform, capture on). 8-bit stochastic rounding leaves about
0.4% relative gradient noise, so the logged losses must agree within ``REL_8BIT`` at every
step. A third run at the 2-bit default must stay finite and bring the loss down on a small
data set it can memorise.

Skipped only when the package is missing (both are in requirements-dev.txt).
"""
from __future__ import annotations

import copy
import logging
import os
import tempfile
import warnings
from typing import List

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import actnn_zoo as az
from actnn_zoo.nn._base import QModule

REL_8BIT = 0.01   # |loss_q - loss| / loss per logged step, 8 bits vs the plain model
STEPS = 8


def _assert_same_training(plain: List[float], q8: List[float], q2: List[float]) -> None:
    assert len(plain) == len(q8) == len(q2) == STEPS
    for step, (a, b) in enumerate(zip(plain, q8)):
        assert abs(b - a) <= REL_8BIT * abs(a), (step, a, b)
    assert all(torch.isfinite(torch.tensor(q2)))
    # the mean of the last three steps is at least 5% below the first loss
    assert sum(q2[-3:]) / 3 < 0.95 * q2[0], q2


# ------------------------------------------------------------------ Hugging Face Trainer
def _tiny_gpt2(transformers):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                  n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


class _Tokens(torch.utils.data.Dataset):
    """32 sequences of 16 tokens counting up from a random start (mod 64): a next-token rule
    a tiny model learns in a few steps. The language model loss is computed inside the
    model's forward (``labels``), so capture covers it."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        start = torch.randint(0, 64, (32, 1), generator=g)
        self.ids = (start + torch.arange(16)) % 64

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf_losses(transformers, model: nn.Module, out_dir: str) -> List[float]:
    args = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=8,
        learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens())
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_hugging_face_trainer_trains_a_converted_model():
    transformers = pytest.importorskip("transformers", reason="transformers not installed")
    pytest.importorskip("accelerate", reason="accelerate not installed (Trainer needs it)")
    transformers.logging.set_verbosity_error()
    base = _tiny_gpt2(transformers)
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = _hf_losses(transformers, copy.deepcopy(base), d)
        q8_model = az.convert_model(copy.deepcopy(base), bits=8, strategy="uniform")
        assert any(isinstance(m, QModule) for m in q8_model.modules())
        q8 = _hf_losses(transformers, q8_model, d)
        q2 = _hf_losses(transformers, az.convert_model(copy.deepcopy(base)), d)
    _assert_same_training(plain, q8, q2)


# ------------------------------------------------------------------- PyTorch Lightning
def _lightning():
    try:
        import lightning.pytorch as pl
    except ImportError:
        pl = pytest.importorskip("pytorch_lightning",
                                 reason="neither lightning nor pytorch-lightning installed")
    return pl


def _lit_module(pl):
    class LitCNN(pl.LightningModule):
        """A small CNN; the LightningModule itself is what ``convert_model`` receives."""

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8),
                                     nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                     nn.Linear(8 * 8 * 8, 10))
            self.losses: List[float] = []

        def forward(self, x: Tensor) -> Tensor:
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)

    return LitCNN


def _lit_losses(pl, module, data) -> List[float]:
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=tempfile.gettempdir())
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16, shuffle=False))
    return module.losses


def test_lightning_trains_a_converted_lightning_module():
    pl = _lightning()
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    g = torch.Generator().manual_seed(2)
    data = torch.utils.data.TensorDataset(torch.randn(32, 3, 16, 16, generator=g),
                                          torch.randint(0, 10, (32,), generator=g))
    torch.manual_seed(0)
    base = _lit_module(pl)()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = _lit_losses(pl, copy.deepcopy(base), data)
        q8_module = az.convert_model(copy.deepcopy(base), bits=8, strategy="uniform")
        assert isinstance(q8_module, pl.LightningModule)
        assert any(isinstance(m, QModule) for m in q8_module.modules())
        q8 = _lit_losses(pl, q8_module, data)
        q2 = _lit_losses(pl, az.convert_model(copy.deepcopy(base)), data)
    _assert_same_training(plain, q8, q2)
