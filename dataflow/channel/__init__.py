"""Bounded, pull-based channels between Ray actors, shaped like trio's memory channels.

    producer actor                                          consumer actor
    SendEnd.send() -> Outbox (bounded FIFO of encoded items)
                          ^  channel_take(channel, key, n)  <- pump (one per producer) -> Inbox
                          |  long poll; the reply carries up to n items     ReceiveEnd.recv()
                          '- channel_receiver_closed(channel, key)  <- ReceiveEnd.close()

Items never pass through the driver. A producer's host answers a take as soon as its outbox holds
at least one item (or is closed), with up to `n` items in one reply: under load every round trip
carries a batch, which is where the message rate comes from. A pump asks only for as many items as
its share of the consumer's inbox can hold, so nothing is ever dropped: a full inbox stops the
pump, the outbox fills, and `send()` waits (backpressure). FIFO holds per producer; with several
consumers each item goes to exactly one of them, whichever asks first (balancing by demand).

End of stream is `close()`, never a sentinel: when every producer's outbox is closed and drained,
`recv()` raises EndOfChannel (and `async for` ends). When every consumer has closed its ReceiveEnd,
`send()` raises BrokenChannel. A producer actor that dies makes `recv()` raise ChannelError naming
it. Every async operation is cancellation-safe: cancelled, it leaves the channel unchanged.

Threading: all objects here belong to one event loop (the actor's); they are not thread-safe.
Closing a ReceiveEnd discards what it had prefetched (at most `prefetch` items, plus a reply in
flight), as closing a trio receive channel discards its buffer.

Files:
    errors.py   ChannelError and its kinds (EndOfChannel, BrokenChannel, BadItem, ClosedChannel, WouldBlock)
    send.py     SendEnd (the bounded outbox), ChannelEndpoint (a process's outboxes), SendStatistics
    receive.py  ReceiveEnd (the pumps and the inbox), ReceiveStatistics
    waiting.py  Signal: the broadcast wake-up both ends wait on
    tracked.py  TrackedInput: the ReceiveEnd a hosted node reads, remembering the last item's meta
"""

from dataflow.channel.errors import BadItem, BrokenChannel, ChannelError, ClosedChannel, EndOfChannel, WouldBlock
from dataflow.channel.receive import ReceiveEnd, ReceiveStatistics
from dataflow.channel.send import ChannelEndpoint, SendEnd, SendStatistics

__all__ = ["BadItem", "BrokenChannel", "ChannelEndpoint", "ChannelError", "ClosedChannel", "EndOfChannel",
           "ReceiveEnd", "ReceiveStatistics", "SendEnd", "SendStatistics", "WouldBlock"]
