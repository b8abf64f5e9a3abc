"""Random-weight checkpoints laid out exactly like the official releases of the models arserve
serves (file names, tensor names, shapes, dtypes, containers, index and config JSONs), written
tensor by tensor with numpy only. `python3 -m tools.release_shapes --list`; see README.md."""
