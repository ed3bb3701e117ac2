"""Bytes in and out, knowing nothing of plans: reading source files (`sources`), the torch zip container
(`torch_zip`), the kernel calls that move and flush bytes (`syscalls`), tensor buffers (`buffers`) and
checksums (`checksum`). The executor (`checkpoint.execute`) and the file writers (`checkpoint.write`)
compose them."""
