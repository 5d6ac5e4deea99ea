"""The HTTP gateway: OpenAI API in front, msgspec over ZeroMQ to a worker behind.

Never imports mlx.
"""
