"""Batches of structure-prediction families: tokens of a protein and the atoms of each token.

ESMFold2 (5.24+) folds a complex from per-token features (positions in the chain, chain and
entity ids, molecule type, residue type, token bonds) and a bundle of reference-conformer atoms
(``EsmFold2AtomInputs``: positions, formal charges, element and atom-name codes, the atom ->
token map), plus the ids its bundled ESMC language model reads. Its forward is the trunk: it
returns the distogram logits and takes no labels (the contract's loss is their mean). The
structure and confidence heads, which sample coordinates after the trunk, are not run by it.

The batch here is one protein chain per row: ``TOKENS`` residues of random type, each with
``ATOMS_PER_TOKEN`` atoms at random positions, with the raw codes its ``_prepare_features``
one-hot encodes (element < ``max_atomic_number``, name characters < ``char_vocab_size``).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from torch import nn

BATCH_SIZE, TOKENS, ATOMS_PER_TOKEN = 2, 6, 2
#: The 20 standard amino acids are the first residue types (of ``num_res_types``).
AMINO_ACIDS = 20
#: ESMC's text ids: above its specials (pad 0, bos 1, eos 2, 3), inside its tiny vocabulary.
ESMC_IDS = (4, 24)


def atom_inputs_class(model: nn.Module) -> type | None:
    """The atom-bundle class of ``model``'s forward (its ``atom_inputs`` parameter's annotation),
    or ``None`` when the forward takes no ``atom_inputs``: not a structure model."""
    parameter = inspect.signature(type(model).forward).parameters.get("atom_inputs")
    if parameter is None:
        return None
    annotation = parameter.annotation
    if isinstance(annotation, str):  # postponed annotations: the name in the model's module
        annotation = getattr(sys.modules[type(model).__module__], annotation, None)
    return annotation if isinstance(annotation, type) else None


def structure_batch(model: nn.Module, config: Any, generator: torch.Generator) -> dict[str, Any]:
    """One forward's keyword arguments for a structure model (:func:`atom_inputs_class`)."""
    bundle = atom_inputs_class(model)
    if bundle is None:
        raise TypeError(f"{type(model).__name__}.forward takes no atom_inputs")
    rows, atoms = BATCH_SIZE, TOKENS * ATOMS_PER_TOKEN
    positions = torch.arange(TOKENS).expand(rows, TOKENS)
    zeros = torch.zeros(rows, TOKENS, dtype=torch.long)
    atom_to_token = torch.arange(TOKENS).repeat_interleave(ATOMS_PER_TOKEN).expand(rows, atoms)
    atom_inputs = bundle(
        ref_pos=torch.randn(rows, atoms, 3, generator=generator),
        ref_charge=torch.zeros(rows, atoms),
        atom_attention_mask=torch.ones(rows, atoms, dtype=torch.bool),  # masked_fill needs bool
        ref_element=torch.randint(
            1, int(config.max_atomic_number), (rows, atoms), generator=generator
        ),
        ref_atom_name_chars=torch.randint(
            0,
            int(config.char_vocab_size),
            (rows, atoms, int(config.max_chars)),
            generator=generator,
        ),
        ref_space_uid=atom_to_token.clone(),  # one group per token
        atom_to_token=atom_to_token.clone(),
    )
    return {
        "token_index": positions.clone(),
        "residue_index": positions.clone(),
        "asym_id": zeros.clone(),  # one chain, one entity, one copy
        "sym_id": zeros.clone(),
        "entity_id": zeros.clone(),
        "mol_type": zeros.clone(),  # 0: protein
        "res_type": torch.randint(0, AMINO_ACIDS, (rows, TOKENS), generator=generator),
        "token_bonds": torch.zeros(rows, TOKENS, TOKENS, 1),
        "attention_mask": torch.ones(rows, TOKENS, dtype=torch.long),
        "atom_inputs": atom_inputs,
        "input_ids": torch.randint(*ESMC_IDS, (rows, TOKENS), generator=generator),
    }
