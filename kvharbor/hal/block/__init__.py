"""Block mode: the card's behaviour on an ordinary SSD, a block device or a plain file.

`layout` is the on-disk format, `direct` the aligned O_DIRECT I/O beneath it,
`store` the log-structured device that implements the device protocol.
"""
