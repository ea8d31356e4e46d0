"""What the benches' curve plots share: the labels, grid, legend and the saved PNG."""

from __future__ import annotations

from pathlib import Path


def save_curves(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
