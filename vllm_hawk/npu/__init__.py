"""NPU device side: the bank-buffer API, the emulated Tenstorrent device, and (behind
an import guard) the real device over tt-kmd."""

from vllm_hawk.npu.bank_buffer import BankBufferAPI, BankBufferError, DeviceBuffer

__all__ = ["BankBufferAPI", "BankBufferError", "DeviceBuffer"]
