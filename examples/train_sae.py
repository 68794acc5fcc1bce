"""Train a small sparse autoencoder on a run's activations, in plain PyTorch.

    python examples/train_sae.py RUN_DIR --hook layers.0.resid_post --steps 300

Reads shuffled batches through `actx.ActivationDataset` (run.stream) from
every committed partition but the last, leaving out BOS / first tokens, special tokens
and high-norm outliers (actx.reader.masks), scaled to unit mean norm with the statistics
`compute_stats` stores; then prints the explained variance of the reconstruction on the
held-out last partition. A ReLU SAE with an L1 penalty (Bricken et al. 2023): about what
any SAE trainer does, small enough to read in one sitting.
"""

from __future__ import annotations

import argparse
import sys

import torch

import actx


class SparseAutoencoder(torch.nn.Module):
    """x -> relu(W_enc (x - b_dec) + b_enc) -> W_dec f + b_dec, decoder rows unit norm."""

    def __init__(self, hidden: int, latents: int):
        super().__init__()
        self.w_enc = torch.nn.Parameter(torch.randn(hidden, latents) / hidden ** 0.5)
        self.b_enc = torch.nn.Parameter(torch.zeros(latents))
        self.w_dec = torch.nn.Parameter(self.w_enc.detach().T.clone())
        self.b_dec = torch.nn.Parameter(torch.zeros(hidden))

    def forward(self, x_bd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f_bl = torch.relu((x_bd - self.b_dec) @ self.w_enc + self.b_enc)
        return f_bl @ self.w_dec + self.b_dec, f_bl

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        self.w_dec /= self.w_dec.norm(dim=1, keepdim=True).clamp_min(1e-8)


def explained_variance(sae: SparseAutoencoder, batches) -> float:
    """1 - residual variance / variance, summed over every held-out token."""
    residual, total, sum_x, sum_x2, n = 0.0, 0.0, 0.0, 0.0, 0
    with torch.no_grad():
        for x in batches:
            x = x.double()
            x_hat, _ = sae(x.float())
            residual += float(((x - x_hat.double()) ** 2).sum())
            sum_x = sum_x + x.sum(0)
            sum_x2 += float((x ** 2).sum())
            n += len(x)
    total = sum_x2 - float((sum_x ** 2).sum()) / n
    return 1.0 - residual / total


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run")
    p.add_argument("--hook", default="layers.0.resid_post")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--expansion", type=int, default=4, help="latents per hidden dimension")
    p.add_argument("--l1", type=float, default=3e-2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    args = p.parse_args(argv)
    torch.manual_seed(0)

    run = actx.open_run(args.run)
    if len(run.committed) < 2:
        sys.exit(f"{args.run}: needs 2 committed partitions (one is held out)")
    # The scale, and the norms the outlier mask needs, over the tokens the stream serves
    # (`outlier` is defined by these statistics, so it is not left out of them).
    run.compute_stats([args.hook], exclude=["bos", "special"])
    train, held_out = run.committed[:-1], run.committed[-1:]
    common = dict(exclude=["bos", "special", "outlier"], normalize="sqrt_d_mean_norm")
    data = actx.ActivationDataset(run, args.hook, args.batch_size, epochs=None,
                                  partitions=list(train), **common)
    sae = SparseAutoencoder(run.hook(args.hook).hidden, args.expansion * run.hook(args.hook).hidden)
    opt = torch.optim.Adam(sae.parameters(), lr=args.lr)
    losses = []
    for step, x in enumerate(data.loader(args.workers)):
        if step == args.steps:
            break
        x_hat, f = sae(x)
        mse = ((x_hat - x) ** 2).sum(-1).mean()
        loss = mse + args.l1 * f.abs().sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sae.normalize_decoder()
        losses.append(loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  mse {mse.item():.4f}  "
                  f"L0 {(f > 0).float().sum(-1).mean().item():.1f}", flush=True)
    held = actx.ActivationDataset(run, args.hook, args.batch_size, epochs=1,
                                  drop_last=False, partitions=list(held_out), **common)
    ev = explained_variance(sae, held)
    print(f"explained variance on held-out partition {held_out[0]}: {ev:.3f}")
    return {"losses": losses, "explained_variance": ev}


if __name__ == "__main__":
    main()
