"""The code that runs the built-in model node kinds (torch, models), one file per kind: each class
subclasses its declaration in nodes/<kind>.py, which names it (Node.implementation). Only a node's
own process imports it (dataflow/actor/host.py), never the driver.
"""
