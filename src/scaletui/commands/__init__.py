"""The `scaletui` verbs, one module each (`main(argv) -> int`), over the libraries: serve,
roofline, calibrate, simulate, doctor, build-kernels and tui. `scaletui.cli` picks one; nothing
below this layer imports it."""
