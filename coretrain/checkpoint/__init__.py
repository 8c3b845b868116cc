"""Save and restore a run: one directory per step, committed by an atomic rename.

Layout under ``<output_dir>/checkpoints/``::

    step_00000100/          complete: the rename from its temporary name is the commit
        model.pt            rank 0: model state_dict          } replicated models
        optimizer.pt        rank 0: optimizer state_dict      }
        sharded/            every rank's shards of model + optimizer, written by
                            torch.distributed.checkpoint (FSDP2); .metadata last
        rank_00000.pt       every rank: train state, LR schedule, grad scaler, RNG, plugin states
        checkpoint.json     rank 0: the manifest (layout, world size, optimizer, seq_length,
                            the splits evaluated and logged at this step, the resolved config)
    step_00000200.tmp/      an interrupted save: never loaded
    latest                  text: the newest committed step (a hint; the directories decide)
    best -> step_00000100   the keep-best plugin: the best evaluated step
                            (its checkpointed state says the value); keep_last never deletes it

Saving is synchronous, or with ``checkpoint.async_save`` the training thread only copies the
state to host memory and a background thread writes, fsyncs and commits (:class:`Checkpointer`).
Resuming is :mod:`coretrain.resume`; listing and exporting, the `checkpoint` command of coretrain-plugins. Both read
every file through :mod:`coretrain.safeload` (torch's ``weights_only`` unpickler, a restricted
unpickler for DCP's ``.metadata``) and use the sharded reader only for a checkpoint whose
manifest says it was written sharded: nothing in a checkpoint is ever run.

Layout and commit: :mod:`.layout`; what is saved: :mod:`.state`; writing, synchronous or in
the background: :mod:`.writer`; reading weights: :mod:`.load`; what each file must hold:
:mod:`.schema`. Each name is imported from its module: this package only documents them.
"""
