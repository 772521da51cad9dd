"""Vocabulary transplant: a model given another tokenizer, so that two models of different vocabularies share their
embeddings and output head and can be merged on every tensor.

The target vocabulary is a tokenizer's (another model's, or the union of several, :func:`union_tokenizer`). For every
token of it, the transplanted model's row of the input embedding (and of an untied output head) is:

- **copied** when the model's own vocabulary holds the same token string (a shared token: the row is the model's own,
  bit for bit);
- **new** otherwise, made from a *donor*: a model whose vocabulary holds the token. Three rules (``method``):

  - ``omp`` (the route, as mergekit's tokensurgeon does): orthogonal matching pursuit in the DONOR's space expresses
    the donor's row of the token as a sparse combination of ``k`` rows of the shared tokens (donor rows; the atom
    picked at each step is the shared row most correlated with the residual, after normalising the rows; the
    coefficients are the least-squares fit on the atoms picked so far); the same coefficients applied to those shared
    tokens' rows in the MODEL's space give the new row. When the model's space is a linear map of the donor's over
    the shared tokens (E_model = E_donor M), the new row is the true one as soon as the ``k`` atoms span the target.
    The output head is transplanted the same way with the donor's head rows (a tied donor: its embedding).
  - ``subword`` (a control): the mean of the model's own rows of the pieces its OWN tokenizer cuts the token's text
    into (mergekit's subword rule, mean); a token whose text its tokenizer cannot cut (an empty piece list) gets the
    mean row.
  - ``mean`` (a control): the mean of the model's rows over its own vocabulary (every new token the same row).

A target id that no token of the target vocabulary holds (a gap) and a token no donor holds get the mean row
(counted as ``n_unfilled``). A tied head stays tied (only the embedding is built); an output-head bias keeps the shared
tokens' entries and is 0 for new tokens. The transplanted model's config states the new ``vocab_size`` and the
target tokenizer's special-token ids; it is saved and scored with the target tokenizer.

All arithmetic is float64; rows are written in the model's dtype.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mergescope.errors import MergescopeError

METHODS = ("omp", "subword", "mean")
CONTROLS = ("subword", "mean")

__all__ = ["METHODS", "CONTROLS", "omp", "Donor", "TransplantInfo", "vocab_rows", "vocab_names", "transplant_rows",
           "transplant_model", "transplant_state", "install", "donor_of", "union_tokenizer", "Overlay", "same_vocab"]


# --------------------------------------------------------------------------------------------
# Orthogonal matching pursuit
# --------------------------------------------------------------------------------------------


def omp(targets: torch.Tensor, atoms: torch.Tensor, k: int, rtol: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched orthogonal matching pursuit: for each row y of ``targets`` (B, D), ``k`` rows of ``atoms`` (N, D) and
    coefficients c with y ~ sum_j c_j atoms[idx_j]. Returns (idx (B, k) long, c (B, k) float64).

    Step t picks the atom (not yet picked) whose normalised row is most correlated, in absolute value, with the
    residual; the residual is y minus its projection on the span of the atoms picked (kept as an orthonormal basis,
    classical Gram-Schmidt applied twice); the final coefficients solve R c = Q^T y. A row whose residual falls to
    ``rtol`` of its norm stops there: its remaining slots get coefficient 0 (as does an atom that adds no new
    direction), so an exactly represented target is never refitted on noise. ``k`` is capped at N."""
    if targets.ndim != 2 or atoms.ndim != 2 or targets.shape[1] != atoms.shape[1]:
        raise MergescopeError(f"omp needs targets (B, D) and atoms (N, D) of one width, got {tuple(targets.shape)} and "
                              f"{tuple(atoms.shape)}")
    if k < 1:
        raise MergescopeError(f"omp needs k >= 1 atoms, got {k}")
    y = targets.to(torch.float64)
    a = atoms.to(torch.float64)
    b, d = y.shape
    n = a.shape[0]
    k = min(int(k), n)
    dev = y.device
    norms = a.norm(dim=1)
    an = a / torch.where(norms > 0, norms, torch.ones_like(norms)).unsqueeze(1)
    q = torch.zeros(b, d, k, dtype=torch.float64, device=dev)
    r = torch.zeros(b, k, k, dtype=torch.float64, device=dev)
    idx = torch.zeros(b, k, dtype=torch.long, device=dev)
    picked = torch.zeros(b, n, dtype=torch.bool, device=dev)
    picked[:, norms == 0] = True  # a zero row adds nothing
    rows = torch.arange(b, device=dev)
    ynorm = y.norm(dim=1)
    res = y.clone()
    done = ynorm == 0
    for t in range(k):
        corr = (res @ an.T).abs()
        corr.masked_fill_(picked, -1.0)
        j = corr.argmax(dim=1)
        picked[rows, j] = True
        atom = a[j]
        u = atom
        proj = torch.zeros(b, t, dtype=torch.float64, device=dev)
        if t:
            basis = q[:, :, :t]
            for _ in range(2):  # CGS2: the second pass removes what rounding left of the first
                p = torch.einsum("bdt,bd->bt", basis, u)
                u = u - torch.einsum("bdt,bt->bd", basis, p)
                proj = proj + p
        un = u.norm(dim=1)
        ok = (~done) & (un > 1e-10 * atom.norm(dim=1).clamp_min(1e-300))
        idx[:, t] = j
        r[:, :t, t] = torch.where(ok.unsqueeze(1), proj, torch.zeros_like(proj))
        r[:, t, t] = torch.where(ok, un, torch.ones_like(un))
        q[:, :, t] = torch.where(ok.unsqueeze(1), u / un.clamp_min(1e-300).unsqueeze(1), torch.zeros_like(u))
        qt = q[:, :, : t + 1]
        res = y - torch.einsum("bdt,bt->bd", qt, torch.einsum("bdt,bd->bt", qt, y))
        done = done | (res.norm(dim=1) <= rtol * ynorm)
    rhs = torch.einsum("bdk,bd->bk", q, y).unsqueeze(-1)
    coef = torch.linalg.solve_triangular(r, rhs, upper=True).squeeze(-1)
    return idx, coef


# --------------------------------------------------------------------------------------------
# Vocabularies
# --------------------------------------------------------------------------------------------


def vocab_rows(tokenizer, rows: int | None = None) -> dict[str, int]:
    """token string -> id over the tokenizer's vocabulary (added tokens included), ids below ``rows`` only (a token
    beyond a model's embedding rows has no row)."""
    v = tokenizer.get_vocab()
    return {t: int(i) for t, i in v.items() if rows is None or int(i) < rows}


def same_vocab(tok_a, tok_b) -> bool:
    """The same token strings at the same ids."""
    return tok_a.get_vocab() == tok_b.get_vocab()


def vocab_names(model) -> tuple[str, str | None, str | None, bool]:
    """(input-embedding weight name, output-head weight name or None, output-head bias name or None, tied) in the
    model's state dict."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    mods = {id(m): name for name, m in model.named_modules()}
    if id(emb) not in mods:
        raise MergescopeError(f"{type(model).__name__}: its input embeddings are not a module of the model; a vocabulary "
                              "transplant needs a standard causal LM")
    e_name = f"{mods[id(emb)]}.weight"
    if head is None:
        return e_name, None, None, True
    tied = head.weight is emb.weight
    bias = f"{mods[id(head)]}.bias" if getattr(head, "bias", None) is not None else None
    return e_name, f"{mods[id(head)]}.weight", bias, tied


@dataclass
class Donor:
    """A model that lends its rows of the tokens it holds: its tokenizer's vocabulary, its input embedding and its
    output head (its embedding when tied)."""

    vocab: dict[str, int]
    embed: torch.Tensor
    head: torch.Tensor | None
    name: str = ""


@dataclass
class TransplantInfo:
    """What a transplant did: counts of target tokens, copied (shared) and new ones (per donor), unfilled ones, and the
    OMP fit in the donor's space (mean relative residual |y - sum c atoms| / |y| of the new tokens' embedding rows)."""

    method: str
    k: int
    n_target: int
    n_rows: int
    n_copied: int
    n_new: int
    n_unfilled: int
    new_by_donor: dict[str, int] = field(default_factory=dict)
    omp_rel_residual: float | None = None
    head: str = "untied"

    def metrics(self, prefix: str = "") -> dict[str, float]:
        out = {f"{prefix}n_target_tokens": float(self.n_target), f"{prefix}n_rows": float(self.n_rows),
               f"{prefix}n_copied": float(self.n_copied), f"{prefix}n_new": float(self.n_new),
               f"{prefix}n_unfilled": float(self.n_unfilled)}
        if self.omp_rel_residual is not None:
            out[f"{prefix}omp_rel_residual"] = float(self.omp_rel_residual)
        return out


def _plan(own: dict[str, int], target: dict[str, int], donors: Sequence[Donor]):
    """(copied [(target id, own id)], new per donor [[(target id, donor id, token)]], unfilled target ids)."""
    copied, new, unfilled = [], [[] for _ in donors], []
    for tok, tid in target.items():
        if tok in own:
            copied.append((tid, own[tok]))
            continue
        for i, d in enumerate(donors):
            if tok in d.vocab:
                new[i].append((tid, d.vocab[tok], tok))
                break
        else:
            unfilled.append(tid)
    return copied, new, unfilled


def _omp_rows(own_rows: torch.Tensor, donor_rows: torch.Tensor, own: dict[str, int], donor: Donor,
              new: list[tuple[int, int, str]], k: int, device, batch_bytes: int = 1 << 28) -> tuple[torch.Tensor, float]:
    """New rows by OMP (module doc): (len(new), D) float64 and the summed relative residual in the donor's space."""
    shared = [t for t in donor.vocab if t in own]
    if not shared:
        raise MergescopeError(f"the vocabularies of the model and its donor {donor.name} share no token: OMP has no atoms; "
                              "use transplant control 'mean' or a donor with a related tokenizer")
    atoms_d = donor_rows[torch.tensor([donor.vocab[t] for t in shared])].to(device, torch.float64)
    atoms_o = own_rows[torch.tensor([own[t] for t in shared])].to(device, torch.float64)
    kk = min(int(k), len(shared))
    per = max(1, batch_bytes // (8 * atoms_d.shape[1] * kk + 8 * atoms_d.shape[0]))
    out, resid = [], 0.0
    for s in range(0, len(new), per):
        part = new[s: s + per]
        y = donor_rows[torch.tensor([did for _, did, _ in part])].to(device, torch.float64)
        idx, coef = omp(y, atoms_d, kk)
        fit = torch.einsum("bk,bkd->bd", coef, atoms_d[idx])
        resid += float(((y - fit).norm(dim=1) / y.norm(dim=1).clamp_min(1e-300)).sum())
        out.append(torch.einsum("bk,bkd->bd", coef, atoms_o[idx]).cpu())
    return torch.cat(out), resid


def _subword_rows(own_rows: torch.Tensor, own_tok, target_tok, new: list[tuple[int, int, str]]) -> torch.Tensor:
    """Each new token's text (as the target tokenizer writes it) cut by the model's own tokenizer: the mean of its
    pieces' rows (the mean row when there is no piece with a row)."""
    mean = own_rows.to(torch.float64).mean(0)
    out = torch.empty(len(new), own_rows.shape[1], dtype=torch.float64)
    for i, (_, _, tok) in enumerate(new):
        text = target_tok.convert_tokens_to_string([tok])
        ids = [j for j in own_tok(text, add_special_tokens=False)["input_ids"] if j < own_rows.shape[0]] if text else []
        out[i] = own_rows[torch.tensor(ids)].to(torch.float64).mean(0) if ids else mean
    return out


def transplant_rows(own_rows: torch.Tensor, own: dict[str, int], target: dict[str, int], donors: Sequence[Donor],
                    donor_rows: Sequence[torch.Tensor | None], method: str, k: int = 64, own_tok=None, target_tok=None,
                    device="cpu", n_rows: int | None = None) -> tuple[torch.Tensor, TransplantInfo]:
    """One vocabulary matrix (rows = tokens) moved to the target vocabulary (module doc). ``own``: the model's token ->
    row; ``donor_rows[i]``: donor i's matching matrix (its embedding or its head). Returns (the new matrix in
    ``own_rows``' dtype, n_rows = ``n_rows`` or max target id + 1, what was done)."""
    if method not in METHODS:
        raise MergescopeError(f"vocabulary transplant method '{method}' is unknown: one of {', '.join(METHODS)}")
    size = int(n_rows if n_rows is not None else max(target.values()) + 1)
    copied, new, unfilled = _plan(own, target, donors)
    mean = own_rows[torch.tensor(sorted(set(own.values())))].to(torch.float64).mean(0)
    out = mean.unsqueeze(0).repeat(size, 1)  # gaps and unfilled tokens: the mean row
    if copied:
        tids, oids = zip(*copied)
        out[torch.tensor(tids)] = own_rows[torch.tensor(oids)].to(torch.float64)
    resid, n_fit = 0.0, 0
    for i, part in enumerate(new):
        if not part:
            continue
        tids = torch.tensor([tid for tid, _, _ in part])
        if method == "omp":
            if donor_rows[i] is None:
                raise MergescopeError(f"donor {donors[i].name} has no output head to transplant from")
            rows, r = _omp_rows(own_rows, donor_rows[i], own, donors[i], part, k, device)
            resid, n_fit = resid + r, n_fit + len(part)
        elif method == "subword":
            rows = _subword_rows(own_rows, own_tok, target_tok, part)
        else:
            rows = mean.unsqueeze(0).expand(len(part), -1)
        out[tids] = rows
    info = TransplantInfo(method, int(k), len(target), size, len(copied), sum(len(p) for p in new), len(unfilled),
                          {d.name or str(i): len(p) for i, (d, p) in enumerate(zip(donors, new))},
                          resid / n_fit if n_fit else None)
    return out.to(own_rows.dtype), info


def transplant_state(sd: Mapping[str, torch.Tensor], names: tuple[str, str | None, str | None, bool], own_tok,
                     target_tok, donors: Sequence[Donor], method: str, k: int = 64, device="cpu"
                     ) -> tuple[dict[str, torch.Tensor], TransplantInfo]:
    """The vocabulary tensors of a state dict moved to ``target_tok``'s vocabulary: {name: new tensor} for the input
    embedding, an untied output head and its bias (a tied head: the embedding's new tensor under both names)."""
    e_name, h_name, b_name, tied = names
    emb = sd[e_name]
    own = vocab_rows(own_tok, emb.shape[0])
    target = vocab_rows(target_tok)
    n_rows = max(target.values()) + 1
    new_e, info = transplant_rows(emb, own, target, donors, [d.embed for d in donors], method, k, own_tok, target_tok,
                                  device, n_rows)
    out = {e_name: new_e}
    if h_name is not None and tied:
        out[h_name] = new_e
    elif h_name is not None:
        head = sd[h_name]
        new_h, hinfo = transplant_rows(head, vocab_rows(own_tok, head.shape[0]), target, donors, [d.head for d in donors],
                                       method, k, own_tok, target_tok, device, n_rows)
        out[h_name] = new_h
        if info.omp_rel_residual is not None and hinfo.omp_rel_residual is not None:
            info.omp_rel_residual = (info.omp_rel_residual + hinfo.omp_rel_residual) / 2
        if b_name is not None:
            bias = sd[b_name]
            nb = torch.zeros(n_rows, dtype=bias.dtype)
            for tok, tid in target.items():
                if tok in own and own[tok] < bias.shape[0]:
                    nb[tid] = bias[own[tok]]
            out[b_name] = nb
    info.head = "none" if h_name is None else ("tied" if tied else "untied")
    return out, info


def donor_of(model_or_sd, names: tuple[str, str | None, str | None, bool], tok, name: str) -> Donor:
    """A donor from a loaded model or a state dict (with the vocabulary tensor names of its architecture)."""
    sd = model_or_sd.state_dict() if hasattr(model_or_sd, "state_dict") else model_or_sd
    e_name, h_name, _, tied = names
    emb = sd[e_name].detach()
    head = emb if (h_name is None or tied) else sd[h_name].detach()
    return Donor(vocab_rows(tok, emb.shape[0]), emb, head, name)


def install(model, values: dict[str, torch.Tensor], n_rows: int, target_tok) -> None:
    """Write a transplant's tensors (:func:`transplant_state`) into the loaded ``model``: its vocabulary resized to
    ``n_rows`` (a tied head stays tied), every vocabulary tensor overwritten, its config's ``vocab_size`` and
    special-token ids (bos, eos, pad) the target tokenizer's."""
    model.resize_token_embeddings(int(n_rows), mean_resizing=False)
    sd = model.state_dict()
    with torch.no_grad():
        for name, v in values.items():
            if tuple(sd[name].shape) != tuple(v.shape):
                raise MergescopeError(f"{name}: the resized model holds {tuple(sd[name].shape)}, the transplant made "
                                      f"{tuple(v.shape)}; this architecture's vocabulary tensors are not supported")
            sd[name].copy_(v.to(sd[name].device, sd[name].dtype))
    model.config.vocab_size = int(n_rows)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        tid = getattr(target_tok, key, None)
        if tid is not None:
            setattr(model.config, key, int(tid))
            if getattr(model, "generation_config", None) is not None:
                setattr(model.generation_config, key, int(tid))


def transplant_model(model, own_tok, target_tok, donors: Sequence[Donor], method: str, k: int = 64,
                     device="cpu") -> TransplantInfo:
    """The loaded ``model`` given ``target_tok``'s vocabulary in place (:func:`transplant_state`, :func:`install`)."""
    values, info = transplant_state(model.state_dict(), vocab_names(model), own_tok, target_tok, donors, method, k, device)
    install(model, values, info.n_rows, target_tok)
    return info


class Overlay(Mapping[str, torch.Tensor]):
    """A state dict (streamed or in memory) with some tensors replaced (a transplant's vocabulary tensors): a name tied to
    a replaced one (``ties``) is served the replacement too."""

    def __init__(self, base: Mapping[str, torch.Tensor], values: dict[str, torch.Tensor]):
        self.base = base
        self.values = dict(values)
        self.ties = dict(getattr(base, "ties", {}) or {})

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.values:
            return self.values[name]
        if self.ties.get(name) in self.values:
            return self.values[self.ties[name]]
        return self.base[name]

    def __contains__(self, name: object) -> bool:
        return name in self.base

    def __iter__(self):
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


# --------------------------------------------------------------------------------------------
# Union of BPE tokenizers
# --------------------------------------------------------------------------------------------

_SAME_KIND = ("normalizer", "pre_tokenizer", "post_processor", "decoder")


def _merge_key(m) -> str:
    return m if isinstance(m, str) else " ".join(m)


def union_tokenizer(tokenizers: Sequence[Any], names: Sequence[str] | None = None):
    """The union of BPE tokenizers of one kind (the same normalizer, pre-tokenizer, post-processor and decoder): the
    first one's vocabulary, merges and added tokens at their own ids, then each other's tokens it lacks appended (new
    ids, in that tokenizer's id order) with its merges the union lacks appended after (lower priority), and its added
    tokens. A text the first tokenizer cuts with its own merges is cut the same way unless an appended merge joins two
    of its pieces further. Its special tokens and settings are the first tokenizer's."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    names = list(names or [f"tokenizer {i}" for i in range(len(tokenizers))])
    specs = []
    for t, name in zip(tokenizers, names):
        if not getattr(t, "is_fast", False):
            raise MergescopeError(f"tokenizer_source union: {name}'s tokenizer is not a fast (tokenizers) tokenizer; "
                                  "use tokenizer_source base or a model")
        spec = json.loads(t.backend_tokenizer.to_str())
        if spec["model"]["type"] != "BPE":
            raise MergescopeError(f"tokenizer_source union: {name}'s tokenizer is {spec['model']['type']}, not BPE; the union "
                                  "is built for BPE tokenizers only (use tokenizer_source base or a model)")
        specs.append(spec)
    out = json.loads(json.dumps(specs[0]))
    for spec, name in zip(specs[1:], names[1:]):
        if bad := [k for k in _SAME_KIND if spec.get(k) != out.get(k)]:
            raise MergescopeError(f"tokenizer_source union: {name}'s tokenizer has another {bad[0].replace('_', '-')} than "
                                  f"{names[0]}'s; a union needs tokenizers of one kind (use tokenizer_source base or a model)")
    vocab = out["model"]["vocab"]
    added = {a["content"]: a for a in out.get("added_tokens", [])}
    merges = list(out["model"].get("merges", []))
    seen = {_merge_key(m) for m in merges}
    next_id = max([*vocab.values(), *(a["id"] for a in added.values())]) + 1
    for spec in specs[1:]:
        for tok, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]):
            if tok not in vocab and tok not in added:
                vocab[tok] = next_id
                next_id += 1
        for m in spec["model"].get("merges", []):
            if _merge_key(m) not in seen:
                seen.add(_merge_key(m))
                merges.append(m)
        for a in spec.get("added_tokens", []):
            if a["content"] not in added and a["content"] not in vocab:
                added[a["content"]] = {**a, "id": next_id}
                out.setdefault("added_tokens", []).append(added[a["content"]])
                next_id += 1
    out["model"]["merges"] = merges
    backend = Tokenizer.from_str(json.dumps(out))
    with tempfile.TemporaryDirectory() as d:  # the first tokenizer's settings (special tokens, lengths) with the union
        tokenizers[0].save_pretrained(d)
        backend.save(f"{d}/tokenizer.json")
        return AutoTokenizer.from_pretrained(d, trust_remote_code=False)
