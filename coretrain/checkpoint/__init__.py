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
    best -> step_00000100   a plugin's named link to a step beside it (keep-best's best);
                            followed by resume, pretrained and find_checkpoint(root, "best")

Everything about checkpoints lives in this package, one job per module:

- :mod:`.layout` — the directory layout, the commit, retention, reading a manifest;
- :mod:`.state` — what is saved (model, optimizer, RNG, the manifest's fields);
- :mod:`.writer` — writing, synchronous or in the background (``checkpoint.async_save``);
- :mod:`.saves` — when the loop saves (cadence, end, agreed requests);
- :mod:`.resume` — resuming: choosing the checkpoint, reading it safely, checking that it
  fits the model, applying it;
- :mod:`.pretrained` — weights to start from (``checkpoint.pretrained``), another loop's file too;
- :mod:`.load` — reading weights and optimizer state, whole or sharded;
- :mod:`.safeload` — every file read through torch's ``weights_only`` unpickler, and
  :mod:`.dcpmetadata`, a restricted unpickler for DCP's ``.metadata``: nothing in a checkpoint
  is ever run;
- :mod:`.schema` — what each file must hold, checked before anything is applied.

The sharded reader is used only for a checkpoint whose manifest says it was written sharded.
Listing and exporting are the ``checkpoint`` command of coretrain-plugins, through the public
names (``coretrain.find_checkpoint``, ``read_manifest``, ``read_weights``, ...). Each name is
imported from its module: this package only documents them.
"""
