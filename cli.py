import click
@click.group()
def main():
    """aggdec"""
