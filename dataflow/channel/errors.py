"""What a channel operation raises (dataflow/channel/__init__.py says when)."""

from __future__ import annotations


class ChannelError(Exception):
    """Base class of channel errors. Raised as such when a producer of a ReceiveEnd failed."""


class EndOfChannel(ChannelError):
    """recv() on a channel whose producers all closed and whose items were all received."""


class BrokenChannel(ChannelError):
    """send() on a channel whose consumers all closed their receive ends."""


class BadItem(ChannelError):
    """recv() met an item that fails to decode (names the channel and the producer)."""

    def __init__(self, message: str, channel: str = "", producer: str = ""):
        super().__init__(message)
        self.channel = channel
        self.producer = producer


class ClosedChannel(ChannelError):
    """An operation on an end that this process already closed."""


class WouldBlock(ChannelError):
    """send_nowait() / recv_nowait() could not complete immediately."""
