"""Rank processes on one machine: start each as a fresh interpreter, talk to it over a pipe, stop them all.

A torchrun user never touches this package: under torchrun every process is a rank already.
"""
